#!/usr/bin/env python3
"""One durable 4 KiB append at a time, on the file system holding PATH: an O_DIRECT
write followed by fdatasync (two device round trips: what the log does under
`fsync: on-commit`) against an O_DIRECT|O_DSYNC write (one); each into blocks only
preallocated (unwritten extents, as a log's segment is: every sync also commits the
extent conversion to the journal) and into blocks written with zeros beforehand
(`prezeroed`). Prints p50/p99 per round, alternating the four.

    python3 bench/disk/dsync_vs_fdatasync.py /var/tmp/dsync.test [rounds]
"""
import mmap
import os
import sys
import time

N = 2000


def run(path, flags, do_sync, label, prezero=False):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | flags, 0o644)
    try:
        os.posix_fallocate(fd, 0, 64 << 20)
        if prezero:
            zeros = mmap.mmap(-1, 1 << 20)
            for off in range(0, N * 4096 + (1 << 20), 1 << 20):
                os.pwritev(fd, [zeros], off)
        os.fsync(fd)
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        buf.write(b"x" * 4096)
        lat = []
        for i in range(N):
            t = time.perf_counter_ns()
            os.pwritev(fd, [buf], i * 4096)
            if do_sync:
                os.fdatasync(fd)
            lat.append((time.perf_counter_ns() - t) / 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    lat.sort()
    print(f"{label:28s} p50 {lat[N // 2]:7.1f} us  p99 {lat[int(N * 0.99)]:7.1f} us")


def main():
    path = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    for _ in range(rounds):
        run(path, 0, True, "O_DIRECT write + fdatasync")
        run(path, os.O_DSYNC, False, "O_DIRECT|O_DSYNC write")
        run(path, 0, True, "prezeroed write + fdatasync", True)
        run(path, os.O_DSYNC, False, "prezeroed O_DSYNC write", True)


if __name__ == "__main__":
    main()
