"""One 1 KiB publish at a time through the standard SDK (felix-client), as a
latency-sensitive producer does; prints ack p50/p99 and the broker's CPU per ack.

    python one_at_a_time.py ADDR TOKEN_FILE CA_FILE BROKER_PID [N]

The broker's CPU comes from /proc/BROKER_PID/stat (utime + stime) around the run, so
run the broker as its own process (e.g. `felix-broker dev --fsync none`); pin both with
`--cores` and `taskset` to measure one broker core. docs/benchmarks.md has results.
"""
import os
import sys
import time

import felix

addr, token_path, ca, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
n = int(sys.argv[5]) if len(sys.argv) > 5 else 3000
c = felix.Client(addr, tenant_id="dev", token=open(token_path).read().strip(), ca_file=ca)
payload = b"x" * 1024
for _ in range(200):  # warm-up: connection, stream, first segment
    c.publish("dev", "default", "lat", payload, ack="per_message")


def cpu_seconds():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


lat = []
c0, t0 = cpu_seconds(), time.perf_counter()
for _ in range(n):
    s = time.perf_counter()
    c.publish("dev", "default", "lat", payload, ack="per_message")
    lat.append((time.perf_counter() - s) * 1e6)
wall, c1 = time.perf_counter() - t0, cpu_seconds()
lat.sort()
print(
    f"n={n} p50={lat[n // 2]:.0f}us p99={lat[int(n * 0.99)]:.0f}us "
    f"rate={n / wall:.0f}/s broker_cpu_per_ack={(c1 - c0) / n * 1e6:.0f}us"
)
