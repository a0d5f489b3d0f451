"""The controller's sequencing: program counter, layer loop and the on-device draft loop.

Shared by the functional model (which also executes the units) and the cycle model's
static estimate (which only counts), so both follow one definition of the control flow.
"""

from __future__ import annotations

from dfvg_hw.spec.descriptors import ErrorCode
from dfvg_hw.spec.isa import CONTROL_OPS, Cond, Instruction, Op

__all__ = ["ProgramFlow", "ControlFault", "CONTROL_OPS", "block_address"]


class ControlFault(Exception):
    def __init__(self, code: ErrorCode, detail: str):
        self.code = code
        self.detail = detail
        super().__init__(f"{code.name}: {detail}")


def block_address(ins: Instruction, image_base: int, layer: int, lstride: int) -> int:
    """The device address of ``ins``'s block: image base + ``addr``, plus LAYER·LSTRIDE
    when it is layer-relative."""
    return image_base + ins.addr + (layer * lstride if ins.layer_relative else 0)


class ProgramFlow:
    """Controller registers of one request and the rules that advance them.

    Members
    -------
    pc : int
        Program counter.
    pos : int
        KV position of the current forward (starts at the request's ``start_pos``).
    token : int
        Input token of the current forward.
    layer : int
        LAYER register: the layer-loop iteration (0 outside a loop).
    lstride : int
        LSTRIDE register, set by LOOP: bytes between layer blocks.
    n_drafted : int
        SAMPLEs executed so far in this request: tokens of a chain, levels of a tree.
    forwards : int
        Forward steps completed (NEXT instructions executed).
    tree_width : int
        The request's tree width ``W`` (0: a chain request; docs/isa.md §9.2).
    tree_level : int
        TREE_LEVEL: the level whose nodes this forward feeds (0 in an input forward or a
        chain request).
    halted : bool
    """

    def __init__(self, tokens: list[int], start_pos: int, n_draft: int, *,
                 tree_width: int = 0, tree_pc: int = 0):
        self.tokens = tokens
        self.n_draft = n_draft
        self.tree_width = tree_width
        self.tree_pc = tree_pc
        self.tree_level = 0
        self.pc = 0
        self.pos = start_pos
        self.in_idx = 0
        self.token = tokens[0]
        self.layer = 0
        self.lstride = 0
        self._loop_start: int | None = None
        self._loop_count = 0
        self.n_drafted = 0
        self.forwards = 0
        self.halted = False
        self._sampled = False        # this forward has sampled its token
        self._last = 0

    @property
    def samples_now(self) -> bool:
        """Whether this forward samples a token (the last input, or a drafted token) and
        has not yet."""
        return (self.in_idx == len(self.tokens) - 1 and self.n_drafted < self.n_draft
                and not self._sampled)

    @property
    def tree_forward(self) -> bool:
        """This forward feeds a tree level's nodes as rows (docs/isa.md §9.2)."""
        return self.tree_level > 0

    @property
    def rows_expected(self) -> int:
        """The rows EMBED, KVAPPEND, ATTN and LOGITS must have in this forward."""
        return self.tree_width if self.tree_forward else 1

    @property
    def tree_base(self) -> int:
        """``P0``: the position after the last input (a tree's first level)."""
        return self.pos - self.tree_level + 1 if self.tree_forward else self.pos + 1

    @property
    def token_is_drafted(self) -> bool:
        """TOKEN came from the sampler: every input token has had its forward."""
        return self.forwards >= len(self.tokens)

    def block_address(self, ins: Instruction, image_base: int) -> int:
        """The device address of ``ins``'s block (:func:`block_address`)."""
        return block_address(ins, image_base, self.layer, self.lstride)

    def drafted(self, token: int) -> None:
        """Record a token the sampler produced; a SAMPLE the controller did not expect faults."""
        if not self.samples_now:
            raise ControlFault(ErrorCode.PROGRAM, "SAMPLE in a forward that drafts no token; "
                               "guard it with BRANCH cond=no_sample")
        self.n_drafted += 1
        self._sampled = True
        self._last = token

    def control(self, ins: Instruction) -> None:
        """Execute a control instruction (HALT, LOOP, ENDLOOP, BRANCH, NEXT) and advance."""
        op, next_pc = ins.opcode, self.pc + 1
        if op == Op.HALT:
            self.halted = True
        elif op == Op.LOOP:
            if self._loop_start is not None:
                raise ControlFault(ErrorCode.PROGRAM, "LOOP inside a LOOP")
            if ins.n == 0:
                raise ControlFault(ErrorCode.PROGRAM, "LOOP with a trip count of 0")
            self._loop_start, self._loop_count, self.layer, self.lstride = next_pc, ins.n, 0, ins.addr
        elif op == Op.ENDLOOP:
            if self._loop_start is None:
                raise ControlFault(ErrorCode.PROGRAM, "ENDLOOP without LOOP")
            self.layer += 1
            if self.layer < self._loop_count:
                next_pc = self._loop_start
            else:
                self._loop_start, self.layer = None, 0
        elif op == Op.BRANCH:
            if ins.flags == Cond.ALWAYS or (ins.flags == Cond.NO_SAMPLE and not self.samples_now):
                next_pc = ins.n
        elif op == Op.NEXT:
            if self._loop_start is not None:
                raise ControlFault(ErrorCode.PROGRAM, "NEXT inside a LOOP")
            if self.samples_now:
                raise ControlFault(ErrorCode.PROGRAM, "NEXT ends a forward that had to sample a "
                                   "token, but no SAMPLE ran")
            self._sampled = False
            self.forwards += 1
            self.pos += 1
            if self.in_idx < len(self.tokens) - 1:
                self.in_idx += 1
                self.token, next_pc = self.tokens[self.in_idx], ins.n
            elif self.n_drafted < self.n_draft and self.tree_width:
                self.tree_level += 1
                next_pc = self.tree_pc
            elif self.n_drafted < self.n_draft:
                self.token, next_pc = self._last, ins.n
        else:
            raise ValueError(f"{op.name} is not a control instruction")
        self.pc = next_pc
