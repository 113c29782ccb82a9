"""Run a command where the kernel refuses to make user namespaces, as an ordinary user.

Why: `egressd exec` must say so (and run the child as it is) where unprivileged user namespaces are
off (`kernel.unprivileged_userns_clone=0`, Ubuntu's AppArmor restriction, `user.max_user_namespaces`
at 0). This makes that real for one process tree: it enters a new user namespace, sets that
namespace's `max_user_namespaces` to 0 (its creator may, before it runs anything), and runs the
command there under an id that is not root (root would need no user namespace), so any user
namespace the command tries to make fails with ENOSPC, as on such a machine.

Run: ``python tests/support/no_userns.py CMD [ARGS...]``.
"""

from __future__ import annotations

import os
import sys

NOT_ROOT = 1000  # the id inside when the caller is root: anything but 0


def main() -> None:
    uid, gid = os.getuid(), os.getgid()
    inside_uid, inside_gid = (uid, gid) if uid != 0 else (NOT_ROOT, NOT_ROOT)
    os.unshare(os.CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as handle:
        handle.write("deny")
    with open("/proc/self/uid_map", "w") as handle:
        handle.write(f"{inside_uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as handle:
        handle.write(f"{inside_gid} {gid} 1")
    with open("/proc/sys/user/max_user_namespaces", "w") as handle:
        handle.write("0")
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
