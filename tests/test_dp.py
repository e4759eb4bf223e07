"""Client-level differential privacy (``--plugins ...,dp``): clipping, the
accountant against a hand-computed epsilon, noise taking effect, one-line
errors for impossible options."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedaval import hookimpl
from fedaval.api import format_summary, run_training
from fedaval.errors import FedavalUsageError
from fedaval.options import build_options
from fedaval.plugins.dp import DPOptions, privatise
from fedaval.plugins.dp_math import clip_and_noise, epsilon, global_norm, sample_rate

DP = "fedaval.plugins.dp:DP"


def test_clipping_scales_the_whole_upload_to_the_clip_norm():
    # v = (3, 4 | 12): ||v|| = 13; clip 2.6 = 13 / 5 -> v / 5 = (0.6, 0.8 | 2.4)
    clipped, norm = clip_and_noise([torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])], clip=2.6, noise_multiplier=0.0)
    assert norm == pytest.approx(13.0)
    assert torch.allclose(clipped[0], torch.tensor([0.6, 0.8]))
    assert torch.allclose(clipped[1], torch.tensor([[2.4]]))
    # below the clip norm nothing changes
    same, _ = clip_and_noise([torch.tensor([3.0, 4.0])], clip=10.0, noise_multiplier=0.0)
    assert torch.equal(same[0], torch.tensor([3.0, 4.0]))


def test_noise_has_std_noise_multiplier_times_clip():
    torch.manual_seed(0)
    noisy, _ = clip_and_noise([torch.zeros(200_000)], clip=0.5, noise_multiplier=3.0)
    assert noisy[0].std().item() == pytest.approx(1.5, rel=0.01)


def test_privatise_clips_the_weight_update_and_prototypes_together():
    """The upload of FedAvg + a prototype method: weights w = received + update;
    update (3, 4) and prototype (12) form one vector of norm 13, clipped to 1.3."""
    received = {"w": torch.tensor([1.0, 1.0]), "bn.running_mean": torch.tensor([0.0])}
    results = [
        {"weights": {"w": torch.tensor([4.0, 5.0]), "bn.running_mean": torch.tensor([7.0])}},
        {"protos": {3: torch.tensor([12.0])}, "counts": {3: 5}},
    ]
    options = build_options(DPOptions, {"clip": "1.3", "noise": "0"}, "dp")
    out = privatise(results, received, options, buffers={"bn.running_mean"})
    assert torch.allclose(out[0]["weights"]["w"], torch.tensor([1.3, 1.4]))  # 1 + (0.3, 0.4)
    assert torch.equal(out[0]["weights"]["bn.running_mean"], torch.tensor([7.0]))  # buffers=keep: unchanged
    assert torch.allclose(out[1]["protos"][3], torch.tensor([1.2]))
    assert out[1]["counts"] == {3: 5}  # integers pass unchanged
    update = [out[0]["weights"]["w"] - received["w"], out[1]["protos"][3]]
    assert global_norm(update) == pytest.approx(1.3)
    dropped = privatise(results, received, build_options(DPOptions, {"buffers": "drop"}, "dp"), {"bn.running_mean"})
    assert "bn.running_mean" not in dropped[0]["weights"]


def test_epsilon_matches_the_hand_computed_rdp_bound():
    """All clients every round (q = 1), z = 2, 10 rounds, delta = 1e-5.

    The Gaussian mechanism's RDP at order a is a / (2 z^2) per round, so
    10 a / 8 = 1.25 a after 10 rounds; Balle et al. 2020 (Thm. 21) turn it
    into eps(a) = 1.25 a - (ln delta + ln a) / (a - 1) + ln((a - 1) / a).
    On Opacus's grid of orders the minimum is at a = 3.9:
    4.875 + (11.5129 - 1.3610) / 2.9 - 0.2963 = 8.0794 (the continuous
    optimum, a = 3.85, gives 8.0784)."""
    a = 3.9
    by_hand = 1.25 * a - (math.log(1e-5) + math.log(a)) / (a - 1) + math.log((a - 1) / a)
    assert by_hand == pytest.approx(8.0794, abs=1e-4)
    assert epsilon([(2.0, 1.0, 10)], 1e-5) == pytest.approx(by_hand, abs=1e-9)
    # q = 1, z = 1, 10 rounds: 5 a - ...; minimum at a = 2.5 -> 19.0536
    assert epsilon([(1.0, 1.0, 10)], 1e-5) == pytest.approx(19.0536, abs=1e-4)
    assert epsilon([(0.0, 1.0, 1)], 1e-5) == math.inf
    assert sample_rate(0, 10) == 1.0 and sample_rate(3, 10) == 0.3 and sample_rate(3, 2) == 1.0


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("clip", "0", "bad value dp.clip=0.0; must be > 0"),
        ("noise", "-1", "bad value dp.noise=-1.0; must be >= 0"),
        ("delta", "1", "bad value dp.delta=1.0; must be in (0, 1)"),
        ("delta", "0", "bad value dp.delta=0.0; must be in (0, 1)"),
    ],
)
def test_impossible_options_are_one_line_errors(key, value, message):
    with pytest.raises(FedavalUsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_options(DPOptions, {key: value}, "dp")


class UploadNorms:
    """Records the norm of each client's upload as the server receives it:
    weight update and FedProK's prototypes together."""

    name = "upload_norms"

    def __init__(self):
        self.norms = []
        self.sent = {}
        self.with_prototypes = 0

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        self.sent = {k: v.clone() for k, v in download["weights"].items()}

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        params = {n for n, _ in run.server.model.named_parameters()}
        for u in uploads:
            w = u.get("weights")
            protos = list((u.get("fedprok_prototypes") or {}).values())
            self.norms.append(global_norm([w[k] - self.sent[k] for k in w if k in params] + protos))
            self.with_prototypes += bool(protos)


def test_a_fedprok_run_clips_uploads_adds_noise_and_accounts_epsilon(tiny_config, tmp_path):
    clip = 0.05
    norms = UploadNorms()
    clipped = run_training(
        tiny_config(plugins=["fedprok", DP], plugin_options={"dp": {"clip": clip, "noise": 0}}, out=tmp_path / "a"),
        extra_plugins=[norms],
    )
    assert max(norms.norms) <= clip * (1 + 1e-5)  # weights update and prototypes clipped together
    assert norms.with_prototypes == len(norms.norms) == 8
    privacy = clipped["privacy"]["dp"]
    assert privacy["epsilon"] is None and privacy["guarantee"] is False  # no noise: no guarantee
    strict = json.loads((tmp_path / "a" / "results.json").read_text(), parse_constant=pytest.fail)  # no Infinity
    assert "privacy (dp): none (no noise)" in format_summary(clipped, tmp_path / "a")
    assert strict["privacy"]["dp"]["epsilon_by_round"] == [None] * 4
    noisy = run_training(
        tiny_config(plugins=["fedprok", DP], plugin_options={"dp": {"clip": clip, "noise": 1.0}}, out=tmp_path / "b")
    )
    again = run_training(
        tiny_config(plugins=["fedprok", DP], plugin_options={"dp": {"clip": clip, "noise": 1.0}}, out=tmp_path / "c")
    )
    acc = lambda r: [x["global_accuracy"] for x in r["rounds"]]  # noqa: E731
    assert acc(noisy) != acc(clipped)  # the noise takes effect
    assert acc(noisy) == acc(again)  # drawn from the clients' own streams: reproducible
    eps = noisy["privacy"]["dp"]["epsilon_by_round"]
    assert len(eps) == 4 and all(a < b for a, b in zip(eps, eps[1:]))  # grows with rounds
    assert eps[-1] == pytest.approx(epsilon([(1.0, 1.0, 4)], 1e-5))
    assert [r["plugin_metrics"]["dp"]["epsilon"] for r in noisy["rounds"]] == eps
    assert f"privacy (dp): epsilon {eps[-1]:.4g} at delta 1e-05" in format_summary(noisy, tmp_path / "b")


def test_the_sample_rate_is_the_rounds_scheduled_clients_over_the_stages_eligible_ones(tiny_config, tmp_path):
    """fcl-random: a stage that only some clients' sequences reach samples its
    few eligible clients at a higher rate, and the accountant is told so."""
    results = run_training(
        tiny_config(
            plugins=["fedavg", DP],
            scenario="fcl-random",
            scenario_options={"clients": 5, "min_tasks": 1, "max_tasks": 3},
            clients_per_round=2,
            rounds_per_task=1,
            out=tmp_path / "run",
        )
    )
    tasks = [len(classes) for classes in results["scenario"]["client_task_classes"]]
    rates = [min(2, e) / e for e in (sum(n > t for n in tasks) for t in range(max(tasks)))]
    assert rates != [rates[0]] * len(rates)  # the seed gives stages of different sizes
    history = [(1.0, q, 1) for q in rates]
    assert [tuple(h) for h in results["privacy"]["dp"]["accountant_history"]] == history
    assert results["privacy"]["dp"]["epsilon"] == pytest.approx(epsilon(history, 1e-5))
    assert results["privacy"]["dp"]["epsilon"] > epsilon([(1.0, 2 / 5, len(rates))], 1e-5)  # the old q = 2 / 5


def test_per_task_client_sampling_claims_no_amplification(tiny_config, tmp_path):
    """``--client-sampling task`` trains a task's drawn clients in all its rounds:
    the rounds are not independently subsampled, so each is accounted at q = 1."""
    results = run_training(
        tiny_config(
            plugins=["fedavg", DP],
            scenario_options={"clients": 4, "tasks": 2},
            clients_per_round=2,
            client_sampling="task",
            rounds_per_task=2,
            out=tmp_path / "run",
        )
    )
    assert [tuple(h) for h in results["privacy"]["dp"]["accountant_history"]] == [(1.0, 1.0, 4)]
    assert results["privacy"]["dp"]["epsilon"] == pytest.approx(epsilon([(1.0, 1.0, 4)], 1e-5))


def test_dp_refuses_a_plugin_whose_server_reads_client_data_outside_the_uploads(tiny_config):
    from fedaval.build import build_run

    tiny = {"vit_patch": 4, "vit_dim": 32, "vit_depth": 2, "vit_heads": 2, "vit_mlp_dim": 64}
    with pytest.raises(FedavalUsageError, match=r"cannot protect .* hgp.stats_exchange=true"):
        build_run(tiny_config(plugins=["hgp", DP], plugin_options={"hgp": tiny}))
    with pytest.warns(UserWarning, match="randomly initialised"):
        build_run(tiny_config(plugins=["hgp", DP], plugin_options={"hgp": {**tiny, "stats_exchange": "false"}}))


def test_python_floats_in_an_upload_are_noised_and_booleans_kept():
    torch.manual_seed(0)
    [out] = privatise([{"glfc_signal": {"entropy": 2.294, "new_task": True}}], {}, DPOptions(clip=10.0), set())
    assert isinstance(out["glfc_signal"]["entropy"], float) and out["glfc_signal"]["entropy"] != 2.294
    assert out["glfc_signal"]["new_task"] is True


def test_a_frozen_parameter_that_did_not_move_is_sent_as_received_and_the_rest_is_noised():
    torch.manual_seed(0)
    received = {"features.w": torch.ones(3), "classifier.w": torch.zeros(2)}
    upload = {"weights": {"features.w": torch.ones(3), "classifier.w": torch.tensor([0.3, 0.4])}}
    [out] = privatise([upload], received, DPOptions(clip=1.0, noise=1.0), set(), frozen={"features.w"})
    assert torch.equal(out["weights"]["features.w"], torch.ones(3))  # no noise on a weight no one trains
    assert not torch.equal(out["weights"]["classifier.w"], upload["weights"]["classifier.w"])
    moved = {"features.w": torch.full((3,), 2.0), "classifier.w": torch.tensor([0.3, 0.4])}
    [out] = privatise([{"weights": moved}], received, DPOptions(clip=1.0, noise=1.0), set(), frozen={"features.w"})
    assert not torch.equal(out["weights"]["features.w"], moved["features.w"])  # frozen but moved: noised


class ReadsClientData:
    """A third-party method whose server reads the clients' data directly."""

    name = "peek"

    @hookimpl
    def fedaval_server_reads_client_data(self, run):
        return "peek reads every client's images on the server"


def test_any_plugin_that_says_its_server_reads_client_data_is_refused_with_dp(tiny_config):
    from fedaval.build import build_run

    with pytest.raises(FedavalUsageError, match="outside the uploads: peek reads every client's images"):
        build_run(tiny_config(plugins=["fedavg", DP]), extra_plugins=[ReadsClientData()])
    build_run(tiny_config(plugins=["fedavg"]), extra_plugins=[ReadsClientData()])  # without dp: nothing to protect


def test_a_delta_not_below_one_over_the_clients_is_warned_about(tiny_config, caplog):
    from fedaval.build import build_run

    with caplog.at_level("WARNING", logger="fedaval"):
        build_run(tiny_config(plugins=["fedavg", DP], plugin_options={"dp": {"delta": "0.5"}}))
    assert any("dp.delta=0.5 is not below 1/N" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedaval"):
        build_run(tiny_config(plugins=["fedavg", DP]))
    assert not any("dp.delta" in r.getMessage() for r in caplog.records)


def test_an_entry_with_a_reference_is_privatised_as_its_change_from_it():
    """FedWeIT's sparse base is sent as values: clipped whole, a base of norm
    10 became one of norm 1. With its reference (the received rows) the
    clip and the noise act on the client's change, as for ``weights``."""
    units = torch.tensor([0, 2], dtype=torch.int32)
    received = torch.full((2, 3), 4.0)
    upload = {"fedweit_base": {"fc": (units, received + 0.1)}}
    options = DPOptions(clip=1.0, noise=0.0)
    [as_values] = privatise([upload], {}, options, set())
    assert as_values["fedweit_base"]["fc"][1].norm() == pytest.approx(1.0)  # the base itself was clipped
    references = {"fedweit_base": {"fc": (units, received)}}
    [as_change] = privatise([upload], {}, options, set(), references=references)
    assert torch.equal(as_change["fedweit_base"]["fc"][0], units)
    assert torch.allclose(as_change["fedweit_base"]["fc"][1], received + 0.1)  # a change of norm 0.24 < clip
    torch.manual_seed(0)
    [noisy] = privatise([upload], {}, DPOptions(clip=1.0, noise=0.01), set(), references=references)
    assert (noisy["fedweit_base"]["fc"][1] - (received + 0.1)).abs().max() < 0.1  # noise on the change only
    with pytest.raises(ValueError, match="reference of 'fedweit_base' does not match"):
        privatise([upload], {}, options, set(), references={"fedweit_base": {"fc": (units, received[:1])}})


def test_fedweit_under_dp_clips_its_base_update_not_its_base(tiny_config, tmp_path):
    """Clipping alone (no noise) at a clip above the updates' norms (1) leaves a
    FedWeIT run as it is without dp; before FedWeIT answered
    ``fedaval_client_upload_reference`` its whole base was cut to norm 1."""
    settings = dict(scenario_options={"clients": 2, "tasks": 2}, rounds_per_task=2)
    plain = run_training(tiny_config(plugins=["fedweit"], out=tmp_path / "plain", **settings))
    clipped = run_training(
        tiny_config(
            plugins=["fedweit", DP],
            plugin_options={"dp": {"noise": "0", "clip": "1"}},
            out=tmp_path / "dp",
            **settings,
        )
    )
    assert [r["client_accuracy"] for r in plain["rounds"]] == [r["client_accuracy"] for r in clipped["rounds"]]


def test_dropping_buffers_on_a_model_without_any_is_warned_about(tiny_config, caplog):
    """The session-35 audit: ``dp.buffers=drop`` on the MLP trained exactly as
    ``keep``, silently; the CNN shares BatchNorm statistics, so it acts."""
    from fedaval.build import build_run

    said = []
    for model in ("mlp", "cnn"):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fedaval"):
            build_run(tiny_config(plugins=["fedavg", DP], model=model, plugin_options={"dp": {"buffers": "drop"}}))
        said.append([r.getMessage() for r in caplog.records if r.getMessage().startswith("dp.buffers=drop")])
    assert said == [
        ["dp.buffers=drop: the model shares no buffers (no BatchNorm statistics), so nothing is withheld"],
        [],
    ]
