"""Partial sums meet a copy: DTensor all-reduces them before it copies (a ``clone``, a
``contiguous`` or ``reshape`` of a transposed or expanded value, as grouped-query attention's
``repeat_kv`` is). Under ``--manual tp=4`` the zoo's GQA Llama (2 key/value heads) was planned
with partial sums passing through such a copy and reduce-scattered after it; the program
all-reduced them at the copy instead (forward: 8 all-reduces executed where 6 were planned, no
reduce-scatter where 2 were). The rules now stop partial sums at a copy, so the plan reduces
them where the program does; ``--check`` counts the collectives."""

from __future__ import annotations

from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases
from test_fsdp import _manual


def test_gqa_tensor_parallel_plans_reduce_partial_sums_where_the_program_does(tmp_path) -> None:
    plans = {f"{model} tp=4": (model, _manual(model, "tp=4", 4)) for model in ("llama", "qwen2")}
    write_check_cases(tmp_path, plans)
    assert_checks_passed(launch_worker(ROOT / "tests" / "check_worker.py", 4, tmp_path, timeout=600), plans)
