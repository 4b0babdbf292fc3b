"""GrammarBudget: how much host time a constrained sample's grammar may take, per step and on
average per token, before the sample ends with an error.

A grammar's mask is computed on the host for every token it constrains, and its cost is
the request's to choose: a JSON schema's mask is cheap, a regex of free text dearer, and an
ambiguous Lark grammar's (`s: s s | s s s | "a" | "aa"`) grew with every token while
llguidance's own limits (Earley items a step, lexer fuel) let it through (ops/bench/journal.md,
"Costly but valid requests"). The time is charged to the sample that caused it (engine
metering), and bounded here in two ways, each ending the sample with `grammar_budget_exceeded`
(a 400 at the gateway, or an error event on a stream):

- one step: its mask and advance together may take at most `max_step_s`;
- its life: its grammar time may average at most `max_mean_s_per_token` over its outputs,
  the first `num_free_tokens` sharing one allowance (a grammar's first masks are its
  slowest), so a grammar whose masks grow is stopped after a bounded total, long before a
  per-step limit alone would stop it.

The defaults leave about five times the costliest mask measured on the benchmark schemas
and free-text regexes (ops/bench/journal.md, "Costly but valid requests").
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError, RequestErrorCode, RequestFault

__all__ = ["GrammarBudget"]


@dataclass(frozen=True)
class GrammarBudget:
    """Per constrained sample: host time its grammar may take."""

    max_step_s: float = 0.02  # one step's mask and advance
    max_mean_s_per_token: float = 0.002  # on average over its outputs
    num_free_tokens: int = 32  # outputs that share one allowance at the start

    def validate(self) -> None:
        if self.max_step_s <= 0 or self.max_mean_s_per_token <= 0 or self.num_free_tokens < 1:
            raise ConfigError("grammar budgets must be positive")

    def fault(self, step_s: float, total_s: float, num_tokens: int) -> RequestFault | None:
        """Why a sample whose grammar took step_s this step, total_s over num_tokens outputs,
        must end; None while it is within its budget."""
        if step_s > self.max_step_s:
            return RequestFault(
                RequestErrorCode.GRAMMAR_BUDGET_EXCEEDED,
                f"the structured output's grammar took {step_s * 1e3:.1f} ms for one token; "
                f"this server allows {self.max_step_s * 1e3:.0f} ms",
            )
        allowance = self.max_mean_s_per_token * max(num_tokens, self.num_free_tokens)
        if total_s > allowance:
            return RequestFault(
                RequestErrorCode.GRAMMAR_BUDGET_EXCEEDED,
                f"the structured output's grammar took {total_s * 1e3:.0f} ms over "
                f"{num_tokens} tokens; this server allows "
                f"{self.max_mean_s_per_token * 1e3:g} ms a token on average",
            )
        return None
