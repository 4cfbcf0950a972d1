"""The front door: the README stays short and its links resolve, a newcomer's questions are answered near the top of
a README section, its perf test example runs verbatim in a fresh project, and the code under lmsys/ explains itself
without the history of the work (numbered work rounds, commit hashes, dates belong in docs/)."""

import io
import os
import re
import tokenize
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_CHARS = 8000
MARKDOWN = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Lines of a section a reader sees without scrolling: its heading and the first screen below it.
FIRST_SCREEN = 24


def sections(text: str) -> dict[str, list[str]]:
    """The README's `## ` sections: heading -> the lines below it, up to the next `## ` heading."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith("## "):
            current = found.setdefault(line[3:].strip(), [])
        elif current is not None:
            current.append(line)
    return found


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code removed (a link there is not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lowercase, punctuation dropped, spaces to hyphens, a repeated
    heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            yield slug if count == 0 else f"{slug}-{count}"


def relative_links(path: Path) -> list[str]:
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # not http:, https:, mailto:


def test_the_readme_is_at_most_8000_characters():
    size = len(README.read_text())
    assert size <= MAX_README_CHARS, f"README.md is {size} characters; move reference material to docs/"


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_a_file_and_heading_that_exist(page):
    broken = []
    for link in relative_links(page):
        target, _, anchor = link.partition("#")
        file = (page.parent / target).resolve() if target else page
        if not file.exists():
            broken.append(f"{link}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in set(anchors(file)):
            broken.append(f"{link}: no heading with the anchor #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


# A newcomer's questions, and what must be on the first screen of which README section to answer each.
QUESTIONS = {
    "compare the attention tests with the stored baseline":
        ("Everyday commands", "pytest perf_tests -k attention --benchmark-compare"),
    "save a new baseline after an intended change": ("Everyday commands", "--benchmark-save="),
    "why did my test fail, which tolerance": ("Everyday commands", "(#how-a-regression-is-decided)"),
    "use the plugin in my own project": ("Using the plugin in your own project", "pip install"),
    "where the plugin saves baselines": ("Using the plugin in your own project", "<rootdir>/baselines/<GPU>/"),
    "replay a failing seed": ("Everyday commands", "--seed=N"),
}


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_newcomers_question_is_answered_on_the_first_screen_of_a_section(question):
    heading, answer = QUESTIONS[question]
    found = sections(README.read_text())
    assert heading in found, f"README.md has no section '## {heading}'"
    assert answer in "\n".join(found[heading][:FIRST_SCREEN]), f"'{answer}' not near the top of '## {heading}'"


def test_the_rule_has_its_own_section_that_links_to_the_whole_of_it():
    rule = "\n".join(sections(README.read_text()).get("How a regression is decided", []))
    assert "(docs/gate.md)" in rule


def test_ci_runs_the_readme_test_command():
    """.ci/run (what CI runs) is the README's second command: the set-up, then the tests."""
    [command] = [line.split("#")[0].strip() for line in sections(README.read_text())["Two commands"]
                 if "# the tests" in line]
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert steps[-2:] == command.split(" && ")


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## The CPU's speed\n\n[x](b.md) [y](#the-cpus-speed) [z](#nope)\n"
                                   "`[not](a-link.md)` [web](https://example.com)\n")
    assert list(anchors(tmp_path / "a.md")) == ["a-page", "the-cpus-speed"]
    assert relative_links(tmp_path / "a.md") == ["b.md", "#the-cpus-speed", "#nope"]


# --------------------------------------------------------------------------------- no work history in the code

ROUND = re.compile(r"\b(?:session|round)\s+#?\d+\b", re.I)
COMMIT = re.compile(r"\bcommits?\W+(?:\w+\W+){0,2}?[0-9a-f]{7,40}\b", re.I)
# A bare hex token of 7 to 40 characters with a digit and a letter (a short hash), not a number such as 1e999999.
HEX = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?![0-9]+e[0-9]+\b)[0-9a-f]{7,40}(?![\w-])")
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")
HISTORY = {"a numbered work round": ROUND, "a commit hash": COMMIT, "a bare hash": HEX, "a date": DATE}
PACKAGES = ["attention", "distributed", "bench", "top-level modules", "perf"]


def comments_and_docstrings(source: str):
    """(line, text) of every comment and every string that stands as a statement of its own (docstrings)."""
    before = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and before in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            yield token.start[0], token.string
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            before = token.type


def history(paths) -> list[str]:
    hits = []
    for path in paths:
        for line, text in comments_and_docstrings(path.read_text()):
            for what, pattern in HISTORY.items():
                for match in pattern.finditer(text):
                    at = line + text[:match.start()].count("\n")
                    hits.append(f"{path.relative_to(ROOT)}:{at}: {what}: {match.group(0)!r}")
    return hits


def package_files(package: str) -> list[Path]:
    lmsys = ROOT / "lmsys"
    if package == "top-level modules":
        return sorted(lmsys.glob("*.py"))
    return sorted((lmsys / package).rglob("*.py"))


def test_the_history_check_finds_each_kind_of_history():
    source = ('"""Measured 2026-11-24 in session 12."""\n'
              "x = 1  # removed in commit 5a184b2; as at da83f0b\n"
              "y = '2026-11-24 at abc1234'  # a string argument, not a docstring\n"
              "z = 1e999999  # not a hash: 1e999999, 0x7fffffff, deadbeefcafe0\n")
    found = [(line, text) for line, text in comments_and_docstrings(source)]
    assert [line for line, _ in found] == [1, 2, 3, 4]
    kinds = {what for _, text in found for what, pattern in HISTORY.items() if pattern.search(text)}
    assert kinds == set(HISTORY)
    assert not HEX.search("# 1e999999 and 0x7fffffff") and HEX.search("# deadbee1")


@pytest.mark.parametrize("package", PACKAGES)
def test_comments_and_docstrings_under_lmsys_hold_no_work_history(package):
    hits = history(package_files(package))
    assert not hits, "history belongs in docs/, not in the code:\n" + "\n".join(hits)


# --------------------------------------------------------------------------------- the README's perf test example

def readme_example() -> str:
    [example] = re.findall(r"## Writing a perf test\n.*?```python\n(.*?)```", README.read_text(), flags=re.S)
    return example


def test_the_readme_perf_test_runs_verbatim_in_a_fresh_project(pytester, monkeypatch):
    """A project with nothing but the README's example (no conftest, no fixtures of its own), run in a fresh pytest
    process as a user would: it saves, then compares with what it saved, and passes with a verdict. On the CPU the
    plugin's CPU backend times it."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    installed = any(e.value == "lmsys.perf.plugin" for e in entry_points(group="pytest11"))
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(test_example=readme_example())
    fast = ("--benchmark-max-time=0.05", "--benchmark-min-rounds=3", "--perf-max-time=0", "-p", "no:cacheprovider",
            *(() if installed else ("-p", "lmsys.perf.plugin")))
    saved = pytester.runpytest_subprocess(*fast, "--benchmark-save=x", timeout=300)
    assert saved.ret == 0, saved.stdout.str()
    saved.assert_outcomes(passed=1)
    assert len(list((pytester.path / "baselines").glob("*/0001_x.json"))) == 1
    compared = pytester.runpytest_subprocess(*fast, "--benchmark-compare", "--perf-time-tolerance=1", timeout=300)
    assert compared.ret == 0, compared.stdout.str()
    compared.assert_outcomes(passed=1)
    compared.stdout.re_match_lines([r".*test_bf16_matmul.*\bPASS\b.*"])
