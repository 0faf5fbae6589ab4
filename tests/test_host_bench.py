"""scripts/host_bench.py at tiny sizes: the engine's real step path with a stand-in device."""
import json

from scripts_loader import load_script


def test_host_bench_times_every_phase(tmp_path, capsys):
    bench = load_script("host_bench")
    out = tmp_path / "host.json"
    assert bench.main(["--preset", "qwen3-tiny", "--batch-sizes", "1,4", "--context", "20", "--max-model-len", "128",
                       "--steps", "5", "--warmup-steps", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["batch"] for r in results] == [1, 4]
    for r in results:
        for phase in bench.PHASES:  # each step's phase is part of its total, so are the medians
            assert 0 < r[phase] <= r["total"], (r["batch"], phase)
    assert "| 4 |" in capsys.readouterr().out
