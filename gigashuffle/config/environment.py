"""What a config reads from the environment: torchrun's rank variables and the Redis URL."""

from __future__ import annotations

import os

_URL_SCHEMES = ("redis://", "rediss://", "unix://")
_URL_FIX = "use redis://host:port/db, rediss://... or unix:///path/to.sock"
REDIS_URL_ENV = "GIGASHUFFLE_REDIS_URL"

# The rank fields and the variables torchrun (and torch.distributed's other launchers) sets for them, with the
# value a process started by hand has.
RANK_ENV: tuple[tuple[str, str, int], ...] = (
    ("local_rank", "LOCAL_RANK", 0),
    ("global_rank", "RANK", 0),
    ("local_world_size", "LOCAL_WORLD_SIZE", 1),
    ("global_world_size", "WORLD_SIZE", 1),
)


def redis_url_in_use(explicit: str | None, where: str = "redis_url") -> str | None:
    """The one Redis a loader or the CLI is pointed at: ``explicit`` (a config's URL, or ``--redis``), else
    ``$GIGASHUFFLE_REDIS_URL``; None means the embedded server. A URL of another scheme is a ValueError that says
    where it came from."""
    if explicit:
        url = explicit
    elif env_url := os.environ.get(REDIS_URL_ENV):
        where, url = REDIS_URL_ENV, env_url
    else:
        return None
    if not url.startswith(_URL_SCHEMES):
        unset = ", or unset it to use the embedded server" if where == REDIS_URL_ENV else ""
        raise ValueError(f"{where} {url!r} is invalid: {_URL_FIX}{unset}")
    return url


def _env_int(variable: str, field: str, least: int) -> int | None:
    raw = os.environ.get(variable)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = least - 1  # reported below with the raw text
    if value < least:
        raise ValueError(
            f"environment variable {variable}={raw!r} (for DataloaderConfig.{field}) is invalid: it must be an int "
            f">= {least}, as torchrun sets it; unset it, fix the launcher, or pass {field}= to from_env explicitly"
        )
    return value
