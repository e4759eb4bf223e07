"""FedProK in fcil-async on digits: its previous classes read as the client's own
earlier-task classes (fedaval's reading from issue 18 to session 33, patched in
here) against the current code's, the paper's union over every client (Sec. 3.1).

    python benchmarks/fedprok_async_previous.py 0.5      # the consensus rate gamma

Prints the final global accuracy of both for seeds 0, 1 and 2 (3 clients x 3
tasks, 3 rounds x 2 local epochs, lr 0.05). Run folders go to /tmp/fp-async.
"""

import sys

from fedaval.api import run_training
from fedaval.config import RunConfig
from fedaval.plugins import fedprok as fp


def own_previous(self, client):
    now = set(client.tasks.classes[client.task]) if client.task < client.tasks.num_tasks else set()
    return sorted({c for t in range(min(client.task, client.tasks.num_tasks)) for c in client.tasks.classes[t]} - now)


def config(out, seed, consensus):
    return RunConfig(
        dataset="digits",
        scenario="fcil-async",
        scenario_options={"clients": 3, "tasks": 3, "consensus": consensus},
        rounds_per_task=3,
        local_epochs=2,
        lr=0.05,
        momentum=0.0,
        batch_size=32,
        device="cpu",
        seed=seed,
        out=out,
        plugins=["fedprok"],
    )


def main() -> None:
    consensus = float(sys.argv[1]) if len(sys.argv) > 1 else 0.5
    current = fp.FedProK.previous_classes
    for seed in (0, 1, 2):
        fp.FedProK.previous_classes = own_previous
        a = run_training(config(f"/tmp/fp-async/own-{consensus}-s{seed}", seed, consensus))
        fp.FedProK.previous_classes = current
        b = run_training(config(f"/tmp/fp-async/now-{consensus}-s{seed}", seed, consensus))
        print(
            seed,
            "own:",
            round(a["final"]["accuracy"], 4),
            "| federation (current code):",
            round(b["final"]["accuracy"], 4),
            flush=True,
        )


if __name__ == "__main__":
    main()
