"""Benchmarks of the loader against a copy floor and a torch DataLoader baseline (``gigashuffle bench``).

* :mod:`.workloads`: the row layouts and sizes, and the repeating-chunk dataset that feeds them;
* :mod:`.baselines`: the copy floor, the DataLoader baseline and the shared timing loop;
* :mod:`.quality`: shuffle quality of the row ids that come out, against an ideal buffer (numpy only);
* :mod:`.runner`: ``run_workload``, ``format_table`` and ``main`` for the CLI.

Nothing here imports the loader until a loader measurement is asked for.
"""
