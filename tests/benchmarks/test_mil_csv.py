"""Reading MIL CSV files for the benchmarks on real data, and the benchmarks' result files.

A user runs ``benchmarks/real_mil.py --data-dir`` on their own MIL data sets: a file the loader
misreads gives wrong numbers without a word, so every misreading here must be an error naming the
file, row and field, and a folder must skip what it cannot read and keep the rest.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import common, package_mil, real_mil
from benchmarks.mil_csv import MILFileError, load_mil_csv, load_mil_folder, mil_csv_files

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_numeric_bag_ids_are_exact_and_ordered_by_value(tmp_path):
    """Ids above 2^53 were parsed as float64 and two bags merged into one; ids are ordered by value
    (10 after 2), the order the committed results were split in."""
    big = 1730000000000000000
    text = (f"1,{big + 1},1,2\n1,{big + 1},3,4\n0,{big + 2},5,6\n0,{big + 2},7,8\n"
            "1,10,0,0\n0,2,1,1\n")
    bags, y = load_mil_csv(write(tmp_path / "d.csv", text))
    assert [len(b) for b in bags] == [1, 1, 2, 2]
    assert y.tolist() == [0, 1, 1, 0]
    np.testing.assert_array_equal(bags[3], [[5.0, 6.0], [7.0, 8.0]])


def test_text_bag_ids_keep_their_bags(tmp_path):
    bags, y = load_mil_csv(write(tmp_path / "d.csv", "1,scan_b,1,2\n0,scan_a,3,4\n1,scan_b,5,6\n"))
    assert y.tolist() == [0, 1]
    np.testing.assert_array_equal(bags[1], [[1.0, 2.0], [5.0, 6.0]])


def test_one_number_written_two_ways_is_refused(tmp_path):
    with pytest.raises(MILFileError, match=r"d\.csv: bag ids '01' and '1' are the same number"):
        load_mil_csv(write(tmp_path / "d.csv", "1,1,0\n0,01,1\n"))


def test_minus_one_plus_one_labels_and_a_byte_order_mark(tmp_path):
    bags, y = load_mil_csv(write(tmp_path / "d.csv", "\ufeff-1,1,0.5\n1,2,1.5\n1,2,2.5\n"))
    assert y.tolist() == [0, 1] and y.dtype.kind == "i"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"no rows"),
        ("label,bag,f1\n1,1,0.5\n", r"row 1: label 'label' is not 0/1 or -1/\+1"),
        ("1,1,0.5\n0.5,2,1\n", r"row 2: label '0.5' is not 0/1 or -1/\+1"),
        ("1,1,0.5\n2,2,1\n", r"row 2: label '2'"),
        ("-1,1,0.5\n0,2,1\n", r"labels mix -1 and 0"),
        ("1,1,0.5,1\n0,2,1\n", r"row 2 has 3 fields"),
        ("1,1\n", r"row 1 has 2 fields"),
        ("1,1,0.5\n0,2,abc\n", r"row 2, column 3: 'abc' is not a number"),
        ("1,1,0.5,nan\n0,2,1,1\n", r"row 1, column 4: feature 'nan' is not finite"),
        ("1;1;0.5\n", r"row 1 has 1 fields"),
    ],
)
def test_malformed_files_are_one_line_errors_naming_file_and_row(tmp_path, text, message):
    with pytest.raises(MILFileError, match=r"d\.csv: " + message) as err:
        load_mil_csv(write(tmp_path / "d.csv", text))
    assert "\n" not in str(err.value)


def test_a_folder_skips_what_it_cannot_read_and_keeps_the_rest(tmp_path, capsys):
    good = "".join(f"{b % 2},{b},{b}.0\n" for b in range(10))
    write(tmp_path / "good.csv", good)
    write(tmp_path / "empty.csv", "")
    write(tmp_path / "few.csv", "".join(f"{int(b == 0)},{b},{b}.0\n" for b in range(10)))  # one positive bag
    write(tmp_path / "notes.txt", "not data")
    (tmp_path / "dir.csv").mkdir()
    sets = load_mil_folder(tmp_path, min_bags_per_class=5)
    assert list(sets) == ["good"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("skipped ") and "empty.csv: no rows" in err[0]
    assert "few.csv: 1 positive and 9 negative bags; each class needs at least 5" in err[1]


def test_a_folder_with_nothing_usable_exits_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no such folder"):
        mil_csv_files(tmp_path / "missing")
    with pytest.raises(SystemExit, match="no \\*.csv files"):
        mil_csv_files(tmp_path)
    write(tmp_path / "UPPER.CSV", "1,1,0\n")
    assert [p.name for p in mil_csv_files(tmp_path)] == ["UPPER.CSV"]
    with pytest.raises(SystemExit, match="no usable data set"):
        load_mil_folder(tmp_path, min_bags_per_class=5)


def test_results_are_written_atomically(tmp_path):
    """A write that fails half-way (here: a file-size limit, as a full disk) leaves the previous
    results as they were; ``Path.write_text`` left a truncated file in their place."""
    script = f"""
import resource, signal, sys
from pathlib import Path
from benchmarks import common
common.RESULTS = Path({str(tmp_path)!r})
if sys.argv[1] == "limited":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
common.write_json("run", {{"rows": list(range(int(sys.argv[2])))}})
"""
    run = [sys.executable, "-c", script]
    subprocess.run([*run, "free", "10"], check=True, cwd=REPO)
    before = (tmp_path / "run.json").read_bytes()
    failed = subprocess.run([*run, "limited", "5000"], cwd=REPO, capture_output=True, text=True)
    assert failed.returncode != 0 and "File too large" in failed.stderr
    assert (tmp_path / "run.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_a_run_on_another_folder_does_not_overwrite_the_committed_results(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    mine, theirs = tmp_path / "my data", tmp_path / "mil"
    (tmp_path / "real_mil.json").write_text(json.dumps({"data_dir": str(theirs)}))
    assert common.name_for_folder("real_mil", theirs) == "real_mil"
    assert common.name_for_folder("real_mil", mine) == "real_mil_my_data"
    assert common.name_for_folder("linear_span", mine) == "linear_span"  # no such file yet


def test_real_mil_refuses_settings_that_evaluate_nothing(tmp_path):
    write(tmp_path / "d.csv", "".join(f"{b % 2},{b},{b}.0\n" for b in range(10)))
    with pytest.raises(SystemExit, match="--seeds must be at least 1"):
        real_mil.main(["--data-dir", str(tmp_path), "--seeds", "0"])
    with pytest.raises(SystemExit, match="none given"):
        real_mil.main(["--data-dir", str(tmp_path), "--models"])


def test_package_mil_refuses_an_out_folder_with_other_data_sets(tmp_path):
    """Its sets are judged by running real_mil on the whole folder: a CSV already there was judged
    with them and its rows written under package_mil's name."""
    write(tmp_path / "mine.csv", "1,1,0\n")
    with pytest.raises(SystemExit, match=r"holds other CSV files \(mine\.csv\)"):
        package_mil.main(["--out", str(tmp_path)])
