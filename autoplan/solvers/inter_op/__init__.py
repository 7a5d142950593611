"""Inter-op DP (Alpa §5.2): cut a chain of layers into pipeline stages, give each a sub-mesh.

Pure mathematics: numbers in, choices out (no torch). One module per job:

* :mod:`.problem`: the chain, the cluster, sub-meshes, stage costs, the step time;
* :mod:`.stages`: allowed stage counts, the stages worth pricing, the memoised cost oracle;
* :mod:`.dp`: :func:`solve_inter_op`, Alpa's DP (its docstring states the mathematics);
* :mod:`.brute_force`, :mod:`.explain`: enumeration (tests), text.
"""

from autoplan.solvers.inter_op.brute_force import BRUTE_FORCE_LIMIT, brute_force_inter_op
from autoplan.solvers.inter_op.dp import solve_inter_op
from autoplan.solvers.inter_op.explain import explain_inter_op
from autoplan.solvers.inter_op.problem import (InterOpInfeasibleError, InterOpProblem, InterOpSolution,
    StageAssignment, StageCost, StageCostFn, SubMesh, candidate_submeshes, pipeline_step_time, problem_submeshes)
from autoplan.solvers.inter_op.stages import StageOracle, StagePins, allowed_stage_counts, usable_stages

__all__ = [
    "BRUTE_FORCE_LIMIT",
    "InterOpInfeasibleError",
    "InterOpProblem",
    "InterOpSolution",
    "StageAssignment",
    "StageCost",
    "StageCostFn",
    "StageOracle",
    "StagePins",
    "SubMesh",
    "allowed_stage_counts",
    "brute_force_inter_op",
    "candidate_submeshes",
    "explain_inter_op",
    "pipeline_step_time",
    "problem_submeshes",
    "solve_inter_op",
    "usable_stages",
]
