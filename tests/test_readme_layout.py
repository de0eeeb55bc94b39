"""docs/layout.md's Layout block names every module of l3plugin/ and nothing that is not there; README.md's
Layout block names every folder and top-level module and sends the reader to docs/layout.md; the docs it
links exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "l3plugin"


LAYOUT_PAGE = ROOT / "docs" / "layout.md"


def layout_entries(page: Path = LAYOUT_PAGE) -> dict[str, str]:
    """{entry as written ("zero/", "comm.py"): its text (with continuation lines)} of the Layout block: the
    first code block under '# Layout' / '## Layout' of ``page`` (docs/layout.md: every module; README.md: one
    line per folder)."""
    text = page.read_text()
    block = re.search(r"^##? Layout.*?^```\n(.*?)^```", text, re.S | re.M)
    assert block, f"{page.name} has no Layout code block under a 'Layout' heading"
    entries, current = {}, None
    for line in block.group(1).splitlines():
        if line.startswith("l3plugin/") or not line.strip():
            continue
        if not line.startswith("  "):  # a top-level file of the repository (l3plugin_autoload.py)
            names, current = [line.split()[0]], None
            entries[names[0]] = line
            continue
        if line.startswith("   "):  # continuation of the entry above
            for name in current or []:
                entries[name] += " " + line.strip()
            continue
        head = re.match(r"  ([^\s,]+(?:, [^\s,]+)*)\s", line + " ").group(1)
        current = [name.strip() for name in head.split(",")]
        for name in current:
            entries[name] = line
    return entries


def modules() -> dict[str, list[str]]:
    """{top-level entry ("zero/", "comm.py"): module file names inside it} of the l3plugin/ tree."""
    out = {}
    for path in sorted(PACKAGE.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            out[path.name + "/"] = sorted(p.name for p in path.glob("*.py"))
        elif path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            out[path.name] = []
    return out


def test_layout_names_every_module_and_only_existing_ones():
    entries, tree = layout_entries(), modules()
    missing = sorted(set(tree) - set(entries))
    assert not missing, f"docs/layout.md Layout does not name {missing}: add a line for each"
    stale = sorted(name for name in set(entries) - set(tree) if not (ROOT / name).exists())
    assert not stale, f"docs/layout.md Layout names {stale}, which do not exist under l3plugin/"
    unnamed = {entry: [m for m in files if m != "__init__.py" and m not in entries[entry]]
               for entry, files in tree.items()}
    unnamed = {entry: files for entry, files in unnamed.items() if files}
    assert not unnamed, f"docs/layout.md Layout does not name these modules in their folder's entry: {unnamed}"
    gone = {entry: [m for m in re.findall(r"\b(\w+\.py)\b", entries[entry]) if m not in files]
            for entry, files in tree.items() if entry.endswith("/")}
    gone = {entry: names for entry, names in gone.items() if names}
    assert not gone, f"docs/layout.md Layout names modules its folders do not have: {gone}"


def test_readme_layout_names_every_folder_and_sends_the_reader_to_every_module():
    entries, tree = layout_entries(ROOT / "README.md"), modules()
    missing = sorted(set(tree) - set(entries))
    assert not missing, f"README.md Layout does not name {missing}: add a line for each (modules: docs/layout.md)"
    stale = sorted(name for name in set(entries) - set(tree) if not (ROOT / name).exists())
    assert not stale, f"README.md Layout names {stale}, which do not exist under l3plugin/"
    section = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    assert "](docs/layout.md)" in section, "README.md's Layout must link docs/layout.md, where every module is named"


def test_readme_links_point_at_existing_files():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert links and not missing, missing
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            assert "://" in link or (page.parent / link).exists(), f"{page.name} links to missing {link}"
