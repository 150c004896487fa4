"""README.md's engine snippet ("Using it from an engine") runs as written and does what its
comments say."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _engine_snippet() -> str:
    text = README.read_text()
    part = text[text.index("## Using it from an engine"):]
    return re.search(r"```python\n(.*?)```", part, re.S).group(1)


def test_engine_snippet_runs(capsys):
    code = _engine_snippet()
    env: dict = {}
    exec(compile(code, "README.md", "exec"), env)
    sched, plan = env["sched"], env["plan"]
    assert plan.admitted == [("a", 0, 3)]
    assert capsys.readouterr().out.strip() == "[('a', 0, 3)] None []"
    assert not sched.running and "a" not in sched.reqs  # finished and dropped
    assert sched.evictable == 0  # 4 tokens < one 16-token page: nothing cached, all freed
    assert sched.available == 1_000_000
    assert {k: v.tolist() for k, v in env["slots"].items()} == {"a": [0, 1, 2]}  # one KV slot per prefilled prompt token, before the forward
    assert env["decode_slots"] == {"a": 3}  # the first output token's slot, before its decode forward
    ratio = env["ratio"]
    assert ratio.init == 0.7 and ratio.value == 0.7 - ratio.decay_step  # one decode step fitted: one decay
