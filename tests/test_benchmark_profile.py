"""``python -m benchmarks.profile`` on the CPU at the smoke scale: it
profiles the steps, writes their per-op times and compiled HLO, and the
op times it reads are the compiled program's own ops."""

import json
import re

from benchmarks import profile


def test_profile_smoke(tmp_path, capsys):
  profile.main(["--model", "gpt", "--scale", "smoke", "--method",
                "plain,dp_all", "--steps", "2", "--top", "3",
                "--out", str(tmp_path)])
  out = json.loads((tmp_path / "profile.json").read_text())
  assert set(out["results"]) == {"plain", "dp_all"}
  for method, r in out["results"].items():
    hlo = (tmp_path / f"gpt_{method}.hlo.txt").read_text()
    assert "ENTRY" in hlo
    assert r["ops"] and r["total_ns"] > 0
    assert r["total_ns"] == sum(op["ns"] for op in r["ops"])
    # Every op of the compiled program the profile names is in its HLO.
    # (A TPU names an op by its HLO line, a CPU by its instruction name;
    # the CPU also lists its thunk executor.)
    named = [op["name"].split(" = ")[0].lstrip("%") for op in r["ops"]]
    named = [n for n in named if re.fullmatch(r"[\w.\-]+", n)]
    assert named and all(f"%{n} = " in hlo for n in named)
  assert "dp_all:" in capsys.readouterr().out
