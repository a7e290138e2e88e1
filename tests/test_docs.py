"""The project's front door: README.md stays short, README.md and docs/ speak to users (no
issue numbers, no wording of our GPU visits), every relative link resolves, and the README's
test command is the one CI runs. Text only: no torch import."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Checklist part names of the GPU script (`first`, `k`, `ks`, `g1`, ...): "part `ks`", "part k's",
# "parts `k`, `kd`", "gpu_checklist.sh k|t|q".
PART = r"(?:first|k|t|q|k2|ks|kd|kq|p|g1|g2|a|b|c|d|e|f)"
FORBIDDEN = {
    "an issue number": r"\bissues?\s+#?\d+",
    "an issue reference (#N)": r"(?<![\w&/#])#\d+\b",
    "a checklist part": rf"\bparts?\s+(?:`{PART}`|{PART}(?:'s)?(?=[\s,.;:)]|$))",
    "a checklist part named in a command": rf"gpu_checklist\.sh\s+`?{PART}\b",
    "a checklist item": r"\bchecklist items?\s+\d",
    "a GPU-visit budget": r"\b1[05]-minute\b",
    "a GPU visit": r"\bGPU (?:visits?|calls?|sessions?)\b|\bone-command\b",
    "the GPU machine's output folder": r"\$OUT\b",
    "the GPU machine's commit variable": r"\bROCKETKV_COMMIT\b",
    "device time": r"\bdevice time\b",
    "a borrowed or lent GPU": r"\bborrowed GPU\b|\b(?:GPU|machine) (?:was|is|were) lent\b"
                              r"|\blent (?:a|the|to|us)\b",
}

BAD = [  # sentences of the old text each pattern must catch
    "Issue 47's target, our `full` step at most 0.5x transformers' time",
    "the GPU visit budget (issue 46)",
    "as asked in #48, the grid",
    "Issues 27 and 28 tightened the limits above",
    "the split selection is the next measurement (part `ks`).",
    "comparisons, such as part k's count before the kernels",
    "the rows with the kernels (part `k2`) are not measured yet",
    "written by parts `k`, `kd`, `kq`",
    "run the checklist `bash scripts/gpu_checklist.sh k|t|q $OUT`",
    "Checklist item 4; budget 256, batch 1",
    "the session's 15-minute budget",
    "a GPU visit is one prepared command",
    "each one 10-minute command of a later visit",
    "Prefix it with `ROCKETKV_COMMIT=<hash>`",
    "15 minutes of device time in all",
    "has not been made: no GPU was lent.",
    "the GPU call's time limit",
    "a one-command GPU visit",
]
GOOD = [  # ordinary English and anchors the patterns must let through
    "the limit is not part of the resume key",
    "the part no method keeps by position alone",
    "A fused layer whose parts mix 4-bit and other blocks",
    "see [the decode step](design.md#the-decode-step) and a call into a compiled region",
    "a 16-bit dot; 32-byte sectors; float32 on CPU; part of a batch",
    "int4 groups of 32 (`int4-g32`) and issue date 2026-11-27",
    "`scripts/gpu_checklist.sh`, a one-shot script that runs the self-check and the charts",
]


def links(text: str) -> list[str]:
    """The targets of the markdown links and images in ``text``, code spans and blocks aside."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)


def slugs(md: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) < 200


@pytest.mark.parametrize("name", FORBIDDEN)
def test_the_patterns_catch_the_old_wording_and_spare_english(name):
    pattern = re.compile(FORBIDDEN[name], re.I)
    assert any(pattern.search(s) for s in BAD), name
    assert not [s for s in GOOD if pattern.search(s)], name
    caught = [s for s in BAD if not any(re.search(p, s, re.I) for p in FORBIDDEN.values())]
    assert not caught, caught


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_pages_speak_to_users(page):
    found = []
    for n, line in enumerate(page.read_text().splitlines(), 1):
        for name, pattern in FORBIDDEN.items():
            if m := re.search(pattern, line, re.I):
                found.append(f"{page.name}:{n}: {name}: {m.group(0)!r}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor.lower() not in slugs(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_link_checker_finds_what_it_must():
    text = "[a](docs/x.md) `[b](no.md)` ![c](img.png \"t\")\n```\n[d](e.md)\n```\n"
    assert links(text) == ["docs/x.md", "img.png"]


def commands(text: str) -> list[str]:
    """The shell commands of ``text``'s bash blocks (continuation lines joined, comments cut),
    each ``&&`` part on its own."""
    out = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line.startswith("#"):
                out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = [c for c in commands("```bash\n" + (ROOT / ".ci/run").read_text() + "```")
          if not c.startswith(("set ", "cd "))]
    readme = commands(README.read_text())
    ci_tests = [c for c in ci if "pytest" in c]
    readme_tests = [c for c in readme if "pytest" in c.split()[:3]]
    assert len(ci_tests) == 1 and readme_tests == ci_tests, (readme_tests, ci_tests)
    # and CI installs every requirements file the README's set-up installs
    wanted = {w for c in readme if c.split()[:2] in (["pip", "install"], ["python", "-m"])
              for w in re.findall(r"-r\s+(\S+)", c)}
    installed = {w for c in ci for w in re.findall(r"-r\s+(\S+)", c)}
    assert wanted and wanted <= installed, (wanted, installed)
    assert shlex.split(readme_tests[0])[:3] == ["python", "-m", "pytest"]
