"""examples/rl_prefix_tree.py: GRPO steps on packed prefix trees with a Flax nnx policy.

Packed rows of trees (a GRPO group; a forest of a group and a multi-turn tree with branches)
give every token the log-probability it has on its path run alone, and one optax step from the
same initialisation gives the same parameters, on dense and on chunked attention; the
rollouts' bookkeeping counts each trained token once; the example runs and its loss falls."""

import re

import _examples
import numpy as np
import pytest

rl = _examples.load("rl_prefix_tree")


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
def test_packed_log_probs_and_one_step_equal_alone(implementation):
  res = rl.check(rl.make_rollouts(0, 96), implementation)
  assert res["logprobs"] < 1e-5, res
  assert res["params"] < 1e-5, res


def test_each_trained_token_counts_once():
  ro = rl.make_rollouts(1, 96)
  weight, advantage = np.asarray(ro.weight), np.asarray(ro.advantage)
  np.testing.assert_allclose(weight.sum(), 1.0, rtol=1e-6)
  # The alone layout's weights are the packed ones, each token on the path that owns it.
  alone = np.asarray(ro.alone(ro.weight)) * ro.owner
  np.testing.assert_allclose(ro.packed(alone), weight)
  # Every response is a leaf path; prompts carry no loss (weight 0, advantage 0).
  assert len(ro.row) == 4 + 3 + 3  # the group of 4; the group of 3; the two turns and 2 + 1
  first = np.asarray(ro.tree.previous) < 0
  assert not (weight[first] > 0).any() and not advantage[first].any()


def test_the_example_runs_and_its_loss_falls(capsys):
  assert rl.main(["--steps", "5"]) == 0
  losses = [float(x) for x in re.findall(r"GRPO loss ([-+.\d]+)", capsys.readouterr().out)]
  assert len(losses) == 5 and losses[-1] < losses[0] - 0.05, losses
