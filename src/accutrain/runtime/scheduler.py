"""The world a cluster scheduler started. Under SLURM's `srun` (or a submitit job) with several tasks, each task's
rank, local rank and the world's size come from the scheduler, the rendezvous from the first host of the step and a
port derived from the job id; they are exported as torchrun's variables (env://), so that the rest of accutrain runs
the tasks as it runs a torchrun world. torchrun's own variables, where present, win. No PyTorch here: the command
line calls this before anything heavy is imported."""
from __future__ import annotations

import os
import re
from typing import MutableMapping, Optional

from accutrain.errors import UserError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
PORTS = (20000, 40000)  # MASTER_PORT = the first + job id mod the span, unless MASTER_PORT is set
SOURCE = "ACCUTRAIN_WORLD_FROM"  # which launcher the exported world came from (for messages)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as SLURM expands it: hosts separated by commas outside brackets, each
    bracket group the first number of its list of numbers and ranges (its zero padding kept), several groups and a
    suffix allowed: `gpu[07-09,12],cpu3` → `gpu07`, `n[001-004]-ib` → `n001-ib`, `a[1-2]b[3-4]` → `a1b3`."""
    text = nodelist.strip()
    first = re.match(r"(?:[^,\[\]]|\[[^\[\]]*\])*", text).group(0)  # up to the first comma outside brackets
    if not first or not re.fullmatch(r"(?:[^,\[\]]|\[\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*\])+", first) or \
            (len(first) < len(text) and text[len(first)] != ","):
        raise UserError(f"cannot read the node list {nodelist!r} (SLURM_STEP_NODELIST / SLURM_JOB_NODELIST): expected "
                        "hosts such as node1,node2 or gpu[07-09,12]")
    return re.sub(r"\[(\d+)[^\]]*\]", r"\1", first)


def port_for(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id)  # array jobs: 1234_5
    if not digits:
        raise UserError(f"cannot derive a port from the job id {job_id!r}: set MASTER_PORT")
    return PORTS[0] + int(digits) % (PORTS[1] - PORTS[0])


def _number(env: MutableMapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise UserError(f"{name}={env.get(name)!r}: expected the scheduler's task number") from None


def slurm_world(env: MutableMapping[str, str]) -> Optional[dict[str, str]]:
    """torchrun's variables for a task of an `srun` step with several tasks, else None. Only step-scoped variables
    count: a batch script sees SLURM_NTASKS and SLURM_PROCID=0 of the whole allocation, but is not a task."""
    if "SLURM_STEP_ID" not in env and "SLURM_STEP_NUM_TASKS" not in env:
        return None
    size = _number(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
    if size < 2:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError(f"SLURM started {size} tasks but gave no node list (SLURM_STEP_NODELIST or "
                        "SLURM_JOB_NODELIST): cannot tell where rank 0 listens; set MASTER_ADDR and MASTER_PORT")
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    return dict(RANK=str(_number(env, "SLURM_PROCID")), WORLD_SIZE=str(size),
                LOCAL_RANK=str(_number(env, "SLURM_LOCALID")),
                MASTER_ADDR=env.get("MASTER_ADDR") or first_host(nodelist),
                MASTER_PORT=env.get("MASTER_PORT") or str(port_for(job)))


def submitit_world(env: MutableMapping[str, str]) -> Optional[dict[str, str]]:
    """torchrun's variables for a task of a submitit job with several tasks (its local executor included), else
    None."""
    if env.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
        return None
    try:
        import submitit
    except ImportError:
        return None
    job = submitit.JobEnvironment()
    if job.num_tasks < 2:
        return None
    host = "127.0.0.1" if env["SUBMITIT_EXECUTOR"] == "local" else job.hostnames[0]
    return dict(RANK=str(job.global_rank), WORLD_SIZE=str(job.num_tasks), LOCAL_RANK=str(job.local_rank),
                MASTER_ADDR=env.get("MASTER_ADDR") or host, MASTER_PORT=env.get("MASTER_PORT") or
                str(port_for(str(job.job_id))))


def adopt_scheduler_world(env: MutableMapping[str, str] = os.environ) -> Optional[str]:
    """Export the world a scheduler started as torchrun's variables; returns its source (`SLURM`, `submitit`), or
    None when torchrun's are already set or no scheduler started several tasks."""
    if all(name in env for name in TORCHRUN):
        return None
    for source, world in (("submitit", submitit_world), ("SLURM", slurm_world)):
        found = world(env)
        if found is not None:
            env.update(found)
            env[SOURCE] = source
            return source
    return None


def launcher_name(env: MutableMapping[str, str] = os.environ) -> str:
    """Who started the processes of a world given by RANK/WORLD_SIZE: torchrun, or the scheduler adopted above."""
    return {"SLURM": "SLURM (srun)", "submitit": "submitit"}.get(env.get(SOURCE, ""), "torchrun")
