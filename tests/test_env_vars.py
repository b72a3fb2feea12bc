"""README's table of environment variables against the code: every `BATCHRUN_*` name in batchrun/, kernels/,
connectors/, scripts/, tests/ and .ci/ (any text file; this file aside, it names none) has a row, every row
names a variable the code still reads, and the test-only ones are the `BATCHRUN_TEST_*` ones."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("batchrun", "kernels", "connectors", "scripts", "tests", ".ci")
NAME = re.compile(r"BATCHRUN_[A-Z0-9_]*[A-Z0-9]")
SECTION = "## Environment variables"


def names_in_code() -> dict[str, str]:
    """Variable -> one file that names it."""
    out = {}
    for folder in FOLDERS:
        for root, dirs, files in os.walk(os.path.join(REPO, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for name in files:
                path = os.path.join(root, name)
                if os.path.samefile(path, __file__):
                    continue
                try:
                    text = open(path, encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue      # binaries, build outputs
                for var in NAME.findall(text):
                    out.setdefault(var, os.path.relpath(path, REPO))
    return out


def readme_rows() -> dict[str, str]:
    """Variable -> its row's "For" column, from the README section's table."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert text.count(SECTION) == 1, f"README.md needs one {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 5 and NAME.search(cells[0]):
            for var in NAME.findall(cells[0]):
                assert var not in rows, f"README.md: {var} has two rows"
                rows[var] = cells[1]
    return rows


def test_every_variable_the_code_names_has_a_readme_row_and_no_row_is_stale():
    code, rows = names_in_code(), readme_rows()
    assert len(code) >= 15 and len(rows) >= 15    # both were read
    missing = {v: f for v, f in code.items() if v not in rows}
    assert not missing, f"BATCHRUN_* variables missing from README.md's {SECTION!r} table: {missing}"
    stale = sorted(set(rows) - set(code))
    assert not stale, f"README.md's {SECTION!r} table names variables no code reads: {stale}"


def test_test_only_variables_and_only_they_are_named_batchrun_test():
    rows = readme_rows()
    assert set(rows.values()) <= {"users", "benchmark scripts", "tests"}, rows
    wrong = sorted(v for v, who in rows.items() if (who == "tests") != v.startswith("BATCHRUN_TEST_"))
    assert not wrong, f"test-only variables must be named BATCHRUN_TEST_* and only they: {wrong}"
