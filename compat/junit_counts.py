"""Per test file: passed / failed / skipped counts of a pytest --junitxml report (for docs/verified.md)."""

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

counts = defaultdict(Counter)
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    where = case.get("classname", "").replace(".", "/") + ".py"
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    counts[where][{"failure": "failed", "error": "failed"}.get(outcome, outcome)] += 1
for where, c in sorted(counts.items()):
    print(f"{where}: " + ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped") if c[k]))
