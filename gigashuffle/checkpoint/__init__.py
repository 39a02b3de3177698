"""Checkpoints: ``state_dict()``/``load_state_dict()``, the cut, the load (elastic included) and where a respawned
writer starts, in one package above the trainer's supervisor.

- ``checkpoints.py``: the object the loader calls; it owns the cut's state (numbers, answers, paused readers) and
  the writers' resume points, and hears the supervisor's events (``Supervisor.on``).
- ``cut.py``: the consistent cut (NOTE [ Checkpoint cut ]); ``savedrows.py`` the arrays its copy fills;
  ``positions.py`` the cut by positions (NOTE [ Positions checkpoint ]); ``unconsumed.py`` batches handed out and
  not trained on.
- ``parts.py``: a rank's part of the checkpoint dict, its format and its checks (docs/checkpoint-format.md);
  ``elastic.py`` and ``rereads.py``: a checkpoint re-split for another layout (NOTE [ Elastic resume ]).
- ``respawn.py``: where a dead writer's successor starts (NOTE [ Respawned writers ] in procs/resume.py).
"""
