"""Security: nothing listens on (or even opens) a network socket; the shared memory is
owner-only under an unguessable name."""

import os
import stat

from helpers import counting_collector


def inet_socket_inodes():
    """Inodes of every TCP and UDP socket (IPv4 and IPv6) of this network namespace."""
    inodes = set()
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                next(f)  # header
                inodes.update(line.split()[9] for line in f)
        except FileNotFoundError:
            continue
    return inodes


def socket_inodes(pid):
    """Inodes of the sockets process ``pid`` holds open."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:[") : -1])
    return out


def test_a_collector_opens_no_network_socket():
    before = socket_inodes(os.getpid()) & inet_socket_inodes()
    with counting_collector("process_slots", total_frames=-1) as c:
        next(c)  # workers and the inference server are up and serving
        inet = inet_socket_inodes()
        assert socket_inodes(os.getpid()) & inet == before, "the driver opened a network socket"
        for pid in c.transport.pids:
            assert not socket_inodes(pid), f"worker {pid} holds a socket"
        name = c.transport.shm_name
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
