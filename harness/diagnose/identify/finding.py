"""`Finding`: what one stage of your loop does, read from its own tensors (harness.diagnose.identify)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one stage of your loop does, read from its tensors."""
    stage: str  # one of CHAIN: selection | rewards | advantages | mask | weighting | objective | optimizer
    step: int | None  # the step whose tensors were read (None: several)
    rule: str  # in words, of your loop ("centres each group's rewards and divides by its population std + 1e-8")
    settings: dict  # spec fields that make the built-in loop do the same ({}: TRL's as the spec sets it up)
    exact: bool  # the rule reproduces your tensors within tolerance
    same_as_spec: bool = False  # the rule is the spec's own (TRL's as configured): nothing to name
    no_switch: bool = False  # a rule the built-in loop has no switch for (named, never searched)
    unsettled: tuple = ()  # what this run could not tell, in words
    evidence: dict = dataclasses.field(default_factory=dict)
    settles: tuple = ()  # the spec fields this finding settles: the search leaves them as found
    readable: bool = True  # False: nothing could be read at this step (all advantages 0, a function scoring alike)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
