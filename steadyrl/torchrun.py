"""torchrun with steadyrl's rendezvous backend registered (`--rdzv-backend steadyrl`,
`shared/runtime/job_rendezvous.py`): `python -m steadyrl.torchrun ARGS` takes torchrun's arguments.
`steadyrl trainer-node` starts it on every node of a multi-node trainer."""

from __future__ import annotations


def main() -> None:
    from torch.distributed import run

    from shared.runtime.job_rendezvous import register

    register()
    run.main()


if __name__ == "__main__":
    main()
