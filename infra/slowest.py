"""Prints the N slowest tests (setup + call + teardown) from the JUnit XML files of the suite's phases."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(count: int, paths: list[Path]) -> None:
    cases = []
    for path in paths:
        if path.is_file():
            for case in ET.parse(path).iter("testcase"):
                cases.append((float(case.get("time", 0)), f"{case.get('classname')}::{case.get('name')}"))
    cases.sort(reverse=True)
    total = sum(t for t, _ in cases)
    print(f"==> the {min(count, len(cases))} slowest of {len(cases)} tests ({total / 60:.1f} test-minutes in all)")
    for seconds, name in cases[:count]:
        print(f"{seconds:8.1f}s  {name}")


if __name__ == "__main__":
    main(int(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
