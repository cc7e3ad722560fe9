"""Input-length specs: parsed without torch, so `planner profile` rejects a bad spec instantly."""
from __future__ import annotations

from planner.errors import UserError

DEFAULT_LENGTHS_SPEC = "1:32,36:128:4,136:256:8"  # dense where the knees are, 72 points
MAX_INPUT_LENGTH = 65536  # tokens in one forward pass; the model and memory checks come later (measure.check_lengths)
MAX_POINTS = 4096  # lengths in one profile: each is warmed up and timed several times


def parse_lengths(spec: str) -> list[int]:
    """'1,2,4', 'a:b' (a..b step 1), 'a:b:s' (a, a+s, ... up to b INCLUSIVE), comma-joined;
    sorted, duplicates removed."""
    out: set[int] = set()
    parts = [p.strip() for p in str(spec).split(",")]
    for part in parts:
        fields = part.split(":")
        try:
            nums = [int(f) for f in fields]
        except ValueError:
            nums = []
        if not nums or len(nums) > 3 or (len(nums) > 1 and nums[1] < nums[0]) or nums[0] < 1 or (len(nums) == 3 and nums[2] < 1):
            raise UserError(
                f"--input-lengths: cannot parse '{part}' in '{spec}' (expected positive integers N, "
                "START:STOP or START:STOP:STEP with STOP >= START, comma-separated)"
            )
        top = nums[1] if len(nums) > 1 else nums[0]
        if top > MAX_INPUT_LENGTH:
            raise UserError(f"--input-lengths: {top} in '{part}' is above the largest forward pass this tool "
                            f"measures ({MAX_INPUT_LENGTH} tokens)")
        rng = range(nums[0], top + 1, nums[2] if len(nums) == 3 else 1)
        if len(out) + len(rng) > MAX_POINTS:
            raise UserError(f"--input-lengths: '{spec}' asks for more than {MAX_POINTS} lengths; use a STEP")
        out.update(rng)
    return sorted(out)


def default_input_lengths() -> list[int]:
    return parse_lengths(DEFAULT_LENGTHS_SPEC)
