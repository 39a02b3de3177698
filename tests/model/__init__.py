"""Models of gigashuffle's protocols, explored in-process by the tests (tests/model/cutmodel.py)."""
