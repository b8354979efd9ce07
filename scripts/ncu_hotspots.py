#!/usr/bin/env python3
"""Our kernel's hottest SASS instructions by warp-stall samples, from `ncu --page source --csv --print-source sass`.

usage: ncu_hotspots.py SASS_CSV [N]
Prints the total samples, the N instructions with the most samples (with their leading stall reasons where the
listing has per-reason columns) and the samples per opcode.
"""
import collections
import csv
import re
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: ncu_hotspots.py SASS_CSV [N]")
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 25
    with open(sys.argv[1], newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if "Source" in line and "Address" in line), None)
    if start is None:
        sys.exit("ncu_hotspots.py: no SASS listing (header with Address and Source) in " + sys.argv[1])
    rows = list(csv.reader(lines[start:]))
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {name: i for i, name in enumerate(header)}
    sampled = [n for n in header if "Sampling" in n and "All" in n] or [n for n in header if "Sampling" in n]
    if not sampled:
        sys.exit("ncu_hotspots.py: no warp-stall sampling column; columns: " + ", ".join(header))
    samples_col = col[sampled[0]]
    source_col = col["Source"]
    reasons = [i for i, n in enumerate(header) if re.search("stall", n, re.I) and "Sampling" not in n]
    total = sum(number(r[samples_col]) or 0 for r in body)
    print(f"{len(body)} instructions, {total:.0f} stall samples ({sampled[0]})")
    if total == 0:
        return
    hot = sorted(body, key=lambda r: number(r[samples_col]) or 0, reverse=True)[:top]
    for r in hot:
        s = number(r[samples_col]) or 0
        why = sorted(((number(r[i]) or 0, header[i]) for i in reasons), reverse=True)[:3]
        why_text = "; ".join(f"{name} {value:.0f}" for value, name in why if value > 0)
        print(f"{100 * s / total:5.1f}%  {r[col.get('Address', 0)]:>8}  {r[source_col].strip()[:70]:70}  {why_text}")
    per_opcode = collections.Counter()
    for r in body:
        text = re.sub(r"^@!?U?P\w+\s+", "", r[source_col].strip())
        per_opcode[text.split(" ")[0].split(".")[0] if text else "?"] += number(r[samples_col]) or 0
    print("per opcode: " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in per_opcode.most_common(14)))


if __name__ == "__main__":
    main()
