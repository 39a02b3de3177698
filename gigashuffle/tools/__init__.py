"""The ``gigashuffle`` command and what it runs (demo, stats, bench). The library never imports this package."""
