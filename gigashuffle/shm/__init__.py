"""The data plane: one node's rows and the slot table that says what each row holds, in shared memory.

Pure shared memory, numpy and ``flock``: nothing here talks to Redis or knows about processes beyond pids.
"""
