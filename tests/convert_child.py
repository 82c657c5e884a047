"""Runs one conversion and prints the peak of its anonymous memory growth (RssAnon sampled
every 2 ms): file pages (the page cache, a mapped scratch file) are the kernel's to reclaim,
anonymous ones are what a conversion holds."""

import json
import sys
import threading
import time

from dcp_datastates import convert


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    direction, src, dst, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss_anon())
    t = threading.Thread(target=sample)
    t.start()
    calls = []
    opts = convert.ConvertOptions(batch_bytes=batch, progress=lambda d, n, label: calls.append((d, n)))
    if direction == "dcp":
        convert.to_dcp(src, dst, options=opts)
    elif direction == "datastates":
        convert.from_dcp(src, dst, allow_pickle=True, options=opts)
    else:
        convert.to_safetensors(src, dst, options=opts)
    time.sleep(0.01)
    stop.set()
    t.join()
    print(json.dumps({"growth": peak[0] - base, "progress": calls[-1] if calls else None, "calls": len(calls)}))


if __name__ == "__main__":
    main()
