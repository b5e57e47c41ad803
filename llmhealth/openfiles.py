"""Open files: every connection holds a descriptor, and most processes start with 1024.

``watch`` and ``check`` keep a connection to each backend (and the tiny request one
more), the router one per client and one per forwarded request, the exporter one per
scraper: the soft limit a shell or systemd (``DefaultLimitNOFILE=1024:524288``) starts a
process with is exhausted by a fleet of a thousand, and then every read fails at once.
The hard limit is the operator's ceiling; the soft one is ours to raise to it.
"""

from __future__ import annotations

import resource
from typing import Final

# Where the soft limit is raised to when the hard one is unlimited (Linux's nr_open).
FILE_LIMIT_CEILING: Final = 1 << 20


def raise_file_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit; the limit now in force.

    A refusal leaves the limit as it was: the reads that then cannot open a connection
    say so as llmhealth's own failure ("not judged"), never as the server's.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return soft
        return wanted
    return FILE_LIMIT_CEILING if soft == resource.RLIM_INFINITY else soft
