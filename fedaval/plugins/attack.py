"""An honest-but-curious server attacking uploads (``--plugins ...,attack``
during training; ``fedaval attack RUN_DIR --round R`` afterwards, which
replays round R from the checkpoint of round R - 1 with this plugin).

Every ``attack.every`` rounds the server takes ``attack.clients`` of the
round's uploads (a sample drawn from its own generator, seeded by the run's
seed and the round) and reconstructs the client's training images from what
it received (:mod:`fedaval.attack_math`):

* a ``"weights"`` entry: inverting gradients (breaching) on the update
  ``received - uploaded``, for ``attack.images`` images whose labels are the
  client's most frequent current-task labels;
* prototype entries (a dict ``{class: 1-D float tensor}`` of the model's
  feature width: FedProK's, PFCL's): prototype inversion, for up to
  ``attack.images`` classes of the client's current task.

Each reconstruction is scored against the nearest training image of the
client with its label (:func:`fedaval.attack_math.match_nearest`): MSE, PSNR,
SSIM and FedProK's P. Beside it, ``p_guess`` and ``psnr_guess`` score the
data-free guess, the mean test image of each label, the same way: P rewards
an image that looks like a typical one of its class, so a reconstruction
shows leakage beyond knowing the labels only where ``p`` is below
``p_guess`` (the session-34 audit found the guess ahead of the attack on 5
of 8 FedAvg uploads on digits). Results go to results.json's ``privacy.attack`` block
(one entry per attacked upload, plus means), TensorBoard (``Privacy/*``
scalars, a true-vs-reconstructed image grid per upload) and
``RUN_DIR/privacy/round-R-client-K-KIND.png``.

The attack never changes the run: it reads the uploads, works on copies of
models, draws from its own random generators and puts back every global
random stream it may have touched, and writes no round metric (the
results.json rounds are the same with and without it).

Readings chosen:

* *The feature extractor a prototype is inverted through*: the global model
  with the weights the server sent this round, overlaid with the weights
  the client uploaded, when the method shares weights: everything the server
  knows of the client's model. FedProK's first task and GLDP take their
  prototypes under the trained weights they upload (until session 34 the
  attack used the sent weights alone, a model the prototypes did not come
  from, and overstated those methods' privacy); FedProK's later tasks under
  the frozen extractor, which both carry. Otherwise (PFCL: no weight leaves
  a client) the client's own model after the round - a white-box attacker,
  so the reported P is a lower bound on that method's privacy.
* *Single-channel images* (digits): breaching's total-variation prior only
  takes three channels, so it is off for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedaval import hookimpl
from fedaval.options import at_least_one, non_negative, option, positive, refuse_unread
from fedaval.plugin import Plugin


@dataclass
class AttackOptions:
    every: int = option(1, "attack on every N-th round", at_least_one)
    clients: int = option(1, "uploads attacked per attacked round (sampled)", at_least_one)
    ids: list[int] = option([], "attack these client ids instead of a sample (fedaval attack --clients)")
    rounds: list[int] = option([], "attack exactly these rounds instead of every N-th (fedaval attack --round)")
    images: int = option(1, "images reconstructed per weight upload / classes per prototype upload", at_least_one)
    iterations: int = option(200, "optimisation steps per reconstruction", at_least_one)
    tv: float = option(0.2, "total-variation prior weight (weights attack; 0.05 x this for prototypes)", non_negative)
    step_size: float = option(0.1, "step size of the optimiser on the image", positive)
    folder: str = option("", "where the PNG grids go (empty: RUN_DIR/privacy)")


class Attack(Plugin):
    """Server-side reconstruction attacks on a sample of uploads; state
    (server): ``received`` (this round's broadcast weights, while the round
    is attacked) and ``results`` (one dict per attacked upload)."""

    name = "attack"
    description = "honest-but-curious server: inverting-gradients / prototype-inversion attacks, P/PSNR/SSIM"
    Options = AttackOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.received: dict | None = None
        self.results: list[dict[str, Any]] = []

    @hookimpl
    def fedaval_setup(self, run):
        """A grid folder that cannot be made, and clients or rounds the run
        does not have (nothing would be attacked, silently), are one-line
        errors now, not a failure after the first attacked round."""
        from fedaval.errors import FedavalUsageError

        known = {
            "ids": (self.options.ids, range(len(run.partition.clients))),
            "rounds": (self.options.rounds, range(1, len(run.schedule) + 1)),
        }
        o = self.options
        refuse_unread(
            "attack",
            o,
            [
                (("every",), bool(o.rounds), f"rounds={','.join(map(str, o.rounds))}"),
                (("clients",), bool(o.ids), f"ids={','.join(map(str, o.ids))}"),
            ],
        )
        for name, (values, allowed) in known.items():
            wrong = [v for v in values if v not in allowed]
            if wrong:
                raise FedavalUsageError(
                    f"bad value attack.{name}={wrong}; the run's are {allowed.start}..{allowed[-1]}"
                )
        if not self.options.folder:
            return
        folder = Path(self.options.folder)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FedavalUsageError(f"attack.folder={self.options.folder!r} cannot be made ({exc.strerror})") from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise FedavalUsageError(f"attack.folder={self.options.folder!r} is not writable")

    def due(self, round: int) -> bool:
        if self.options.rounds:
            return round in self.options.rounds
        return round % self.options.every == 0

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        if self.due(run.round) and self.received is None:
            self.received = {k: v.detach().clone() for k, v in (download.get("weights") or {}).items()}
        return None

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        received, self.received = self.received, None
        if not self.due(round):
            return None
        from fedaval.random_streams import rng_state, set_rng_state

        outside = rng_state(run.device)
        try:
            for upload in self.targets(run, uploads, round):
                self.results.extend(attack_upload(run, upload, received or {}, round, self.options))
        finally:
            set_rng_state(outside, run.device)
        return None

    def targets(self, run, uploads, round) -> list:
        if self.options.ids:
            return [u for u in uploads if u.client_id in self.options.ids]
        import numpy as np

        rng = np.random.default_rng([run.config.seed, round, 22])  # the attacker's own generator
        picked = sorted(rng.choice(len(uploads), size=min(self.options.clients, len(uploads)), replace=False))
        return [uploads[i] for i in picked]

    def privacy_results(self, run) -> dict[str, Any]:
        """results.json's ``privacy.attack`` block: every attacked upload and the means."""
        return {"attacks": list(self.results), "mean": summarise(self.results)}


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean MSE, PSNR, SSIM and P per kind of upload attacked, and the
    data-free guess's P and PSNR (:func:`label_mean_images`)."""
    out: dict[str, Any] = {}
    for kind in sorted({r["kind"] for r in results}):
        rows = [r for r in results if r["kind"] == kind]
        keys = [k for k in ("mse", "psnr", "ssim", "p", "p_guess", "psnr_guess") if all(k in r for r in rows)]
        out[kind] = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
        out[kind]["attacks"] = len(rows)
    return out


def prototype_entries(upload, feature_dim: int) -> dict[str, dict[int, Any]]:
    """Upload entries that hold class prototypes: ``{class: 1-D float tensor}``
    with ``feature_dim`` values."""
    import torch

    found = {}
    for key, value in upload.entries.items():
        if not isinstance(value, dict) or not value:
            continue
        if all(
            isinstance(c, int)
            and isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dim() == 1
            and t.numel() == feature_dim
            for c, t in value.items()
        ):
            found[key] = value
    return found


def client_images(run, client_id: int, task: int):
    """The client's training images of ``task`` in [0, 1] and their labels."""
    import torch

    client = run.clients[client_id]
    idx = torch.as_tensor(client.tasks.indices[task], dtype=torch.long)
    x = run.data.train_x[idx].float()
    if run.data.train_x.dtype == torch.uint8:
        x = x / 255.0
    return x, run.data.train_y[idx]


def label_mean_images(run, labels):
    """The data-free guess: for each label, the mean test image of that class
    in [0, 1] (non-members: the test split), scored like a reconstruction. An
    attack shows leakage beyond knowing the labels only where its P is below
    the guess's ``p_guess``."""
    import torch

    x = run.data.test_x.float()
    if run.data.test_x.dtype == torch.uint8:
        x = x / 255.0
    y = run.data.test_y
    return torch.stack([x[y == int(c)].mean(0) if bool((y == int(c)).any()) else x.mean(0) for c in labels]).cpu()


def frequent_labels(labels, n: int) -> list[int]:
    """The ``n`` most frequent labels, ties to the lower class id."""
    import collections

    counts = collections.Counter(int(y) for y in labels)
    return [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def attack_upload(run, upload, received: dict, round: int, options: AttackOptions) -> list[dict[str, Any]]:
    """Every attack that applies to ``upload``: one result dict per kind."""
    import copy

    import torch

    from fedaval.attack_math import image_metrics, invert_prototype, invert_update, match_nearest

    task = run.now.task
    true, true_labels = client_images(run, upload.client_id, task)
    shape = tuple(run.data.input_shape)
    tv = options.tv if shape[0] == 3 else 0.0  # breaching's TV prior takes 3 channels only
    seed = int(run.config.seed) * 1_000_003 + round * 1009 + upload.client_id
    out = []
    weights = upload.get("weights")
    if weights:
        labels = torch.tensor(frequent_labels(true_labels, options.images))
        rec = invert_update(
            run.server.model,
            received,
            weights,
            labels,
            shape,
            run.data.mean,
            run.data.std,
            iterations=options.iterations,
            tv=tv,
            step_size=options.step_size,
            seed=seed,
        )
        out.append(("weights", rec, labels))
    model = run.server.model
    for key, protos in prototype_entries(upload, model.feature_dim).items():
        if received:
            # the model the client's prototypes came from, as far as the server knows it: the weights it
            # sent, overlaid with the ones uploaded (FedProK's first task and GLDP take prototypes under
            # the trained weights they upload)
            extractor = copy.deepcopy(model)
            extractor.load_state_dict({**extractor.state_dict(), **received, **(weights or {})})
        else:
            extractor = run.clients[upload.client_id].model  # white box (module docstring)
        classes = [c for c in frequent_labels(true_labels, len(protos)) if c in protos][: options.images]
        if not classes:
            continue
        recs = [
            invert_prototype(
                extractor.features,
                protos[c],
                shape,
                run.data.mean,
                run.data.std,
                iterations=options.iterations,
                tv=0.05 * tv,
                lr=options.step_size,
                seed=seed + c,
            )
            for c in classes
        ]
        out.append((f"prototypes:{key}", torch.cat(recs), torch.tensor(classes)))
    results = []
    for kind, rec, labels in out:
        nearest = match_nearest(rec, labels, true, true_labels)
        metrics = image_metrics(true[nearest], rec)
        guess = label_mean_images(run, labels)  # what knowing the labels alone gives, no upload used
        guessed = image_metrics(true[match_nearest(guess, labels, true, true_labels)], guess)
        grid = save_grids(run, round, upload.client_id, kind, true[nearest], rec, options)
        results.append(
            {
                "round": round,
                "task": task,
                "client": upload.client_id,
                "kind": kind.split(":")[0],
                "entry": kind.split(":")[-1],
                "images": len(rec),
                **metrics,
                "p_guess": guessed["p"],
                "psnr_guess": guessed["psnr"],
                "grid": grid,
            }
        )
    return results


def save_grids(run, round: int, client: int, kind: str, true, rec, options: AttackOptions) -> str | None:
    """PNG under the grid folder and an image in TensorBoard; returns the PNG's
    path (relative to the run folder when inside it)."""
    from fedaval.attack_math import save_grid

    name = f"round-{round:04d}-client-{client}-{kind.split(':')[0]}.png"
    folder = Path(options.folder) if options.folder else (run.out_dir / "privacy" if run.out_dir else None)
    path = None
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        save_grid(true, rec, folder / name)
        path = str(folder / name)
        if run.out_dir is not None and (folder / name).resolve().is_relative_to(Path(run.out_dir).resolve()):
            path = str((folder / name).resolve().relative_to(Path(run.out_dir).resolve()))  # movable run folder
    if run.out_dir is not None:
        import torch
        from torchvision.utils import make_grid

        from fedaval.attack_math import image_metrics
        from fedaval.evaluation import run_writer

        writer = run_writer(run)
        tag = f"Privacy/client{client}/{kind.split(':')[0]}"
        writer.add_image(tag, make_grid(torch.cat([true, rec]).clamp(0, 1), nrow=len(true)), round)
        for key, value in image_metrics(true, rec).items():
            writer.add_scalar(f"{tag}/{key}", value, round)
        writer.flush()
    return path
