"""`make bench`: every benchmark in this folder, one after the other, figures printed."""

from __future__ import annotations

import bench_check
import bench_parse

if __name__ == "__main__":
    print(bench_parse.report(bench_parse.run()))
    print()
    print(bench_check.run(200))
