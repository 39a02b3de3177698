"""Benchmarks of the loader against a copy floor and a torch DataLoader baseline (``gigashuffle bench``).

* :mod:`.workloads`: the row layouts and sizes, and the repeating-chunk dataset that feeds them;
* :mod:`.baselines`: the copy floor, the DataLoader baseline and the shared timing loop;
* :mod:`.quality`: shuffle quality of the row ids that come out, against an ideal buffer (numpy only);
* :mod:`.cpu`: CPU seconds per delivered row by process group;
* :mod:`.ranks`: the trainer ranks 1..R-1 of ``--ranks R``, each its own process, and their window protocol;
* :mod:`.runner`: ``run_workload`` and ``main`` for the CLI;
* :mod:`.report`: ``format_table``, the text tables of a run's results.

Nothing here imports the loader until a loader measurement is asked for.
"""
