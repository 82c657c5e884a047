"""A rank's borrowed ranges: byte ranges of files its node does not hold, which a node-local load
was sent from another node's copy (``replica_repair.py``) and keeps in a subdirectory of the
node's step directory (``format.names.borrowed_dir_name``) while its reads take them.  Each
file there holds only those ranges; it is never listed, replicated or sent as a copy."""

from __future__ import annotations

import logging

from ..format.names import data_file_save_id
from .storage import StorageTier

log = logging.getLogger(__name__)


def clear_borrowed(d: StorageTier) -> bool:
    """Remove what a load borrowed into ``d``, and ``d`` itself; True where it is gone (or was
    never there).  Anything there that this library did not write stays, and so does ``d``."""
    try:
        if not d.is_real_dir():
            return True
        entries = d.entries()
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("%s cannot be listed (%s); left as it is", d.url, e)
        return False
    foreign = [n for n, kind in entries if kind != "file" or data_file_save_id(n) is None]
    for n, kind in entries:
        if kind == "file" and data_file_save_id(n) is not None:
            try:
                d.remove(n)
            except OSError as e:
                log.warning("could not remove %s/%s (%s)", d.url, n, e)
                foreign.append(n)
    if foreign:
        log.warning("%s holds entries dcp-datastates did not write (%s); they are kept, and so is the "
                    "directory", d.url, ", ".join(sorted(foreign)[:8]))
        return False
    try:
        d.remove_dir()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove the directory %s (%s)", d.url, e)
        return False
    return True
