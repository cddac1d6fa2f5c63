"""A policy loss that fails the train stage (a config's `imports` lists this module): a step that fails once its
samples are made, whose cause `--set trainer.loss.policy=dppo` fixes on `--resume`."""

from trace_rl import PolicyLoss, PolicyTokens, register_loss


@register_loss("fails")
def fails(tokens: PolicyTokens, options) -> PolicyLoss:
    raise ValueError(f"the loss 'fails' refuses {int(tokens.lp.numel())} tokens")
