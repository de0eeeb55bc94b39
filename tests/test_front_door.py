"""README.md, the front door, stays short and true: under 150 lines, no table cell over 200 characters; every
figure it gives stands in a page it links (or a run's JSON under docs/runs/); every version in its framework table
is one docs/verified.md (or constraints.txt, the pinned set `make test` runs) names; every make target, l3plugin
subcommand, module, flag, key and environment variable it names exists; every relative link and anchor resolves
(README and docs/); docs/troubleshooting.md quotes messages the package really raises."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES, MAX_CELL = 150, 200
LINK = re.compile(r"\]\(([^)\s]*)\)")


def readme() -> str:
    return README.read_text()


def tables(text: str) -> dict[str, list[list[str]]]:
    """{header line: data rows, each a list of cells} of every markdown table in ``text``."""
    out, lines = {}, text.splitlines()
    for i, (head, rule) in enumerate(zip(lines, lines[1:])):
        if head.startswith("|") and rule.startswith("|---"):
            rows = []
            for line in lines[i + 2:]:
                if not line.startswith("|"):
                    break
                rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
            out[head] = rows
    return out


def table(header_start: str) -> list[list[str]]:
    found = [rows for head, rows in tables(readme()).items() if head.startswith(header_start)]
    assert len(found) == 1, f"README.md has no single table whose header starts {header_start!r}"
    return found[0]


def section(title: str) -> str:
    """The text of README's '## title' section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme(), re.S | re.M)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


# --- short ---------------------------------------------------------------------------------------------------

def test_readme_reads_in_a_minute():
    lines = readme().splitlines()
    assert len(lines) < MAX_LINES, f"README.md has {len(lines)} lines (< {MAX_LINES}): move detail to docs/"


def test_no_readme_table_cell_is_a_paragraph():
    long = [(head[:40], cell[:60] + "...", len(cell)) for head, rows in tables(readme()).items()
            for row in rows for cell in row if len(cell) > MAX_CELL]
    assert not long, f"README.md table cells over {MAX_CELL} characters: {long}"


# --- figures -------------------------------------------------------------------------------------------------

NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?:-\d+(?:\.\d+)?(?:e-?\d+)?)?(?![\w])")


def figures(cell: str) -> list[str]:
    """The numbers of a cell as written ("0.85-0.98", "4.35e-3", "246"), links and code left out."""
    text = re.sub(r"\[[^\]]*\]\([^)]*\)|`[^`]*`", " ", cell)
    return NUMBER.findall(text)


def occurs(figure: str, text: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", text) is not None


def linked_texts(links: list[str]) -> list[str]:
    """The text of each linked page (README-relative), and every JSON under docs/runs/ as written."""
    texts = [(ROOT / link.split("#")[0]).read_text() for link in links
             if "://" not in link and link.split("#")[0].endswith(".md")]
    texts += [path.read_text() for path in sorted((ROOT / "docs" / "runs").glob("*.json"))]
    return texts


def missing_figures(rows: list[list[str]], section_links: list[str], figure_columns: slice) -> list[str]:
    out = []
    for row in rows:
        links = LINK.findall(" | ".join(row)) or section_links
        texts = linked_texts(links)
        for cell in row[figure_columns]:
            out += [f"{figure!r} (row {row[0][:50]!r}; looked in {links})" for figure in figures(cell)
                    if not any(occurs(figure, text) for text in texts)]
    return out


def test_headline_figures_stand_in_the_pages_they_link():
    rows = table("| what | l3plugin | anchor, same run |")
    assert 6 <= len(rows) <= 8, f"the headline table has {len(rows)} rows: 6-8, the rest in docs/benchmarks.md"
    missing = missing_figures(rows, [], slice(0, 3))
    assert not missing, f"README headline figures not found in the page(s) their row links: {missing}"


def test_two_commands_figures_stand_in_the_quickstart():
    rows = table("| command | wall time | what it did |")
    links = [link for link in LINK.findall(section("Two commands")) if link.endswith(".md")]
    assert "docs/quickstart.md" in links
    missing = missing_figures(rows, links, slice(1, 3))
    assert not missing, f"README's two-commands figures not found in docs/quickstart.md: {missing}"


def test_a_changed_figure_is_caught():
    """The check itself: a headline figure changed by one digit is reported."""
    rows = [list(row) for row in table("| what | l3plugin | anchor, same run |")]
    first = figures(rows[0][1])[0]
    changed = re.sub(r"\d(?=\D*$)", lambda m: str((int(m.group()) + 1) % 10), first)
    rows[0][1] = rows[0][1].replace(first, changed, 1)
    assert missing_figures(rows, [], slice(0, 3)), f"{first} -> {changed} went unnoticed"


# --- versions ------------------------------------------------------------------------------------------------

VERSION = re.compile(r"(?<![\d.])\d+\.\d+\.\d+(?![\d.])|\b[0-9a-f]{7}\b")  # also core_v0.19.0's


def test_framework_table_versions_are_the_verified_ones():
    rows = table("| framework | the one change | verified with | details |")
    names = {row[0] for row in rows}
    for framework in ("Megatron-LM", "Megatron-Core", "DeepSpeed", "TRL", "Megatron-DeepSpeed"):
        assert any(framework in name for name in names), f"README's framework table has no {framework} row"
    assert any("verl" in name for name in names), "README's framework table has no verl row"
    verified, pinned = (ROOT / "docs" / "verified.md").read_text(), (ROOT / "constraints.txt").read_text()
    unverified = [(row[0], version) for row in rows for version in VERSION.findall(row[2])
                  if version not in verified and not re.search(rf"=={re.escape(version)}\b", pinned)]
    assert not unverified, f"versions in README's framework table that docs/verified.md does not name: {unverified}"


def test_pinned_versions_in_readme_are_constraints_txt():
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M))
    said = re.findall(r"\b(torch|megatron-core|deepspeed|transformers|accelerate|trl) (\d+\.\d+\.\d+)",
                      re.search(r"^All with torch.*?\n\n", section("Switch it on"), re.S | re.M).group(0))
    assert said, "README's Switch it on names no pinned version under its table"
    wrong = [(name, version, pins.get(name)) for name, version in said if pins.get(name) != version]
    assert not wrong, f"README's pinned versions differ from constraints.txt (name, README, pin): {wrong}"


# --- commands, modules, flags, keys ----------------------------------------------------------------------------

def test_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", readme()))
    assert {"demo", "test"} <= named
    assert not named - targets, f"README names make targets the Makefile lacks: {sorted(named - targets)}"


def test_l3plugin_subcommands_exist():
    named = set(re.findall(r"`l3plugin ([a-z][\w-]*)", readme()))
    named |= set(re.search(r"cli\.py\s+`l3plugin ([^`]*)`", readme()).group(1).replace(" ", "").split("|"))
    out = subprocess.run([sys.executable, "-m", "l3plugin", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    listed = set(re.findall(r"^    ([a-z][\w-]*)", out.stdout, re.M))
    assert named and not named - listed, f"README names l3plugin subcommands the CLI lacks: {sorted(named - listed)}"


def source_text() -> str:
    files = sorted((ROOT / "l3plugin").rglob("*.py")) + [ROOT / "l3plugin_autoload.py"]
    return "\n".join(path.read_text() for path in files)


def test_modules_functions_flags_keys_and_variables_exist():
    text, source = readme(), source_text()
    for module in re.findall(r"-m (l3plugin(?:\.\w+)+)", text):
        path = ROOT / module.replace(".", "/")
        assert path.with_suffix(".py").exists() or (path / "__init__.py").exists(), f"no module {module}"
    for dotted in set(re.findall(r"\b(l3plugin\.\w+(?:\.\w+)*)\(", text)) | {"gpt_layer_spec_with_cp_attention"}:
        name = dotted.rsplit(".", 1)[-1]
        assert re.search(rf"^\s*(def|class) {name}\b|^{name} = ", source, re.M), f"README names {dotted}: not defined"
    for flag in set(re.findall(r"(--(?:pipeline-schedule|cp-comm-type|l3plugin-[\w-]+))", text)):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"README names {flag}: no l3plugin flag"
    assert '"l3plugin_all_gather"' in source
    for variable in set(re.findall(r"\bL3PLUGIN_[A-Z_]+", text)):
        assert f'"{variable}"' in source, f"README names {variable}: l3plugin reads no such variable"
    config = (ROOT / "l3plugin" / "deepspeed" / "config.py").read_text()
    for key in set(re.findall(r'"l3plugin": \{"(\w+)"', text)) | set(re.findall(r', "(\w+)": \d', text)):
        assert f'"{key}"' in config, f"README names the key {key!r}: l3plugin/deepspeed/config.py has no such option"


def test_bench_commands_in_the_benchmarks_index_exist():
    """Each bench the index of docs/benchmarks.md (and README) names exists, with the options given."""
    texts = [readme(), (ROOT / "docs" / "benchmarks.md").read_text().split("\n## ", 1)[0]]
    shared = (ROOT / "bench" / "harness.py").read_text() + (ROOT / "bench" / "wire.py").read_text()
    for text in texts:
        for script, options in re.findall(r"`(bench/\w+\.py)((?: [^`|]*)?)`", text):
            path = ROOT / script
            assert path.exists(), f"{script} does not exist"
            code = path.read_text() + shared
            for flag in re.findall(r"--[\w-]+", options):
                assert f'"{flag}"' in code, f"{script} takes no {flag}"


# --- links -----------------------------------------------------------------------------------------------------

def slugs(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out, seen = set(), {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out | set(re.findall(r'<a (?:id|name)="([^"]+)"', markdown))


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_and_anchors_resolve(page):
    path = README if page == "README.md" else ROOT / "docs" / page
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    broken = []
    for link in LINK.findall(text):
        if "://" in link or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        target_path = path if not target else (path.parent / target)
        if not target_path.exists():
            broken.append(link)
        elif anchor and target_path.suffix == ".md" and anchor not in slugs(target_path.read_text()):
            broken.append(link)
    assert not broken, f"{page}: links that do not resolve: {broken}"


# --- troubleshooting -------------------------------------------------------------------------------------------

def normalized_source() -> str:
    """The package's source with adjacent string literals joined and its message constants filled in."""
    text = source_text()
    text = re.sub(r"""["']\s*\n\s*[rf]*["']""", "", text)  # "...a "\n  f"b..." -> "...a b..."
    text = re.sub(r"""["']\s*\+\s*["']""", "", text)
    names = {"KEY": "l3plugin", "CP_COMM_TYPE": "l3plugin_all_gather", "GROUP_SIZE_ENV": "L3PLUGIN_MICROBATCH_GROUP_SIZE",
             "SCHEDULE_ENV": "L3PLUGIN_PIPELINE_SCHEDULE", "UNCHECKED_ENV": "L3PLUGIN_UNCHECKED_VERSIONS",
             "ENV_VAR": "L3PLUGIN_WAIT_TIMEOUT"}
    for name, value in names.items():
        text = text.replace("{" + name + "}", value)
    return text.replace("\\'", "'").replace('\\"', '"')


def test_troubleshooting_quotes_messages_the_package_raises():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    quotes = re.findall(r"\*\*`(.+?)`\*\*", page.replace("\n", " "))
    assert len(quotes) >= 15, f"docs/troubleshooting.md quotes {len(quotes)} messages"
    source = normalized_source()
    unknown = []
    for quote in quotes:
        for fragment in re.split(r"\{[^}]*\}|\.\.\.|\(\.\.\.\)|\[\.\.\.\]", quote):
            fragment = fragment.strip(" .,:")
            if len(fragment) >= 12 and fragment not in source:
                unknown.append(fragment)
    assert not unknown, f"docs/troubleshooting.md quotes text the package does not raise: {unknown}"


def test_gpu_figures_come_from_a_saved_run():
    """The GPU row of the headline table says so, links the GPU section, and that run's JSON is kept."""
    rows = [row for row in table("| what | l3plugin | anchor, same run |") if "H200" in row[3]]
    assert rows and all("docs/verified.md#on-a-gpu" in row[4] for row in rows), rows
    record = json.loads((ROOT / "docs" / "runs" / "gpu_check_h200.json").read_text())
    assert "H200" in json.dumps(record["environment"]) and (ROOT / "bench" / "gpu_check.py").exists()
    others = [row[0] for row in table("| what | l3plugin | anchor, same run |") if "H200" not in row[3]]
    assert all(not re.search(r"GPU|H100|H200", row) for row in others), f"GPU figures not marked: {others}"


@pytest.mark.parametrize("page, header", [("megatron.md", "| Megatron-Core | how | result |"),
                                          ("deepspeed.md", "| DeepSpeed | transformers / accelerate | result |")])
def test_framework_pages_versions_and_counts_are_the_verified_ones(page, header):
    """The version tables of the per-framework pages: every version and test count is one docs/verified.md gives."""
    rows = tables((ROOT / "docs" / page).read_text()).get(header)
    assert rows, f"docs/{page} has no table {header!r}"
    verified = (ROOT / "docs" / "verified.md").read_text()
    said = [token for row in rows for cell in row for token in VERSION.findall(cell) + re.findall(
        r"\b(\d+) (?:passed|failed|skipped)", cell)]
    wrong = [token for token in said if not occurs(token, verified)]
    assert said and not wrong, f"docs/{page}: versions or counts docs/verified.md does not give: {wrong}"
