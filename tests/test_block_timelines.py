"""scripts/block_timelines.py on the CPU: the timer goes into the forward and into the backward's `_dkdv` (once,
before its body) of every configured point, and the instrumented kernels still compile."""
import json
import runpy
from pathlib import Path

from substation.kernels import attention
from substation.kernels.attention import AttentionBackwardParams, configured_points

ROOT = Path(__file__).parents[1]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "block_timelines.py"))


def test_the_timer_starts_the_timed_kernels_and_they_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("SUBSTATION_CACHE", str(tmp_path))
    for cls in (attention.AttentionParams, AttentionBackwardParams):
        monkeypatch.setattr(cls, "render", cls.render)  # put back after the test
    SCRIPT["time_blocks"]()
    config = json.loads((ROOT / "layouts" / "h100-bert-large-b96-l128.json").read_text(encoding="utf-8"))
    for point in configured_points(config):
        source = point.render()
        assert source.count("SubstationBlockTimer substation_timer;") == 1
        kernel = "_dkdv(BWD_ARGS)" if isinstance(point, AttentionBackwardParams) else point.name + "("
        assert source.index("struct SubstationBlockTimer") < source.index(kernel) < source.index("substation_timer;")
        assert point.compile().path.exists()
