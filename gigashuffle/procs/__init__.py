"""The loader's processes: the zygote that forks them, the writer and reader loops, and how they reach the buffer."""
