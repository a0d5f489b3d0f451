"""ProgramFlow: the controller's program counter, layer loop and on-device draft loop.

The RTL twin of :class:`sim.program_flow.ProgramFlow` (which the functional and cycle models
share): the same registers, advanced by the same rules, with the same faults. The
controller *retires* every instruction into it — a control instruction (HALT, LOOP,
ENDLOOP, BRANCH, NEXT) changes the flow, SAMPLE records the drafted token, anything else
moves on to ``pc + 1`` — and reads back where to fetch next and which token and KV
position the next forward uses. One instruction retires per cycle.

Token supply: a forward's input token is either the request's input token number
``in_idx`` (the controller reads it from the request buffer) or, once the inputs are
used up, the token the sampler drafted in the previous forward (``token_is_drafted``,
``drafted_token``).

Tree requests (``tree_width`` ≥ 1, docs/isa.md §9.2): once the inputs are used up, NEXT
enters a tree forward at ``tree_pc`` (not at its ``n``) and counts ``tree_level``; the
level's nodes and their tokens are the controller's tree registers', so ``token`` and
``token_is_drafted`` stay as the last input forward left them.
"""

from __future__ import annotations

from amaranth import Module, Mux, Signal, unsigned
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from dfvg_hw.spec.descriptors import MAX_DRAFT, ErrorCode
from dfvg_hw.spec.isa import Cond, Op

__all__ = ["ProgramFlow", "ProgramFlowStart", "RetiredInstruction", "ProgramFlowFault"]


class ProgramFlowStart(data.StructLayout):
    """A request's control parameters: first KV position, input token count (≥ 1), tokens
    (levels of a tree) to draft, and the tree's width (0: a chain request) and the tree
    forward's first instruction."""

    def __init__(self):
        super().__init__({"start_pos": unsigned(16), "n_tokens": unsigned(16),
                          "n_draft": unsigned(8), "tree_width": unsigned(8),
                          "tree_pc": unsigned(16)})


class RetiredInstruction(data.StructLayout):
    """An instruction the controller finished: the fields the flow depends on, and for
    SAMPLE the drafted token."""

    def __init__(self):
        super().__init__({"opcode": unsigned(8), "flags": unsigned(8), "n": unsigned(16),
                          "addr": unsigned(32), "token": unsigned(16)})


class ProgramFlowFault(data.StructLayout):
    """A malformed program's fault: ``code`` is an :class:`~dfvg_hw.spec.descriptors.ErrorCode`
    (PROGRAM for every flow rule) and ``pc`` the retiring instruction's address."""

    def __init__(self):
        super().__init__({"valid": 1, "code": unsigned(8), "pc": unsigned(16)})


class ProgramFlow(wiring.Component):
    """Control-flow registers of one request, bit-exact with :class:`sim.program_flow.ProgramFlow`.

    Faults (all ``ErrorCode.PROGRAM``, as the functional model raises them): LOOP inside a
    LOOP, LOOP with a trip count of 0, ENDLOOP without LOOP, NEXT inside a LOOP, NEXT
    ending a forward that had to sample but did not, SAMPLE in a forward that drafts no
    token. A fault or HALT stops retirement until the next ``start``.

    Members
    -------
    start : In(stream.Signature(ProgramFlowStart()))
        Begin a request: ``pc = 0``, ``pos = start_pos``, first input token, no loop.
        Always ready: a request the controller stopped (a unit's fault, ABORT) leaves the
        sequencer mid-program, and the next start must still clear all of it.
    retire : In(stream.Signature(RetiredInstruction()))
        One finished instruction per transfer (always ready while running).
    running : Out(1)
        Started, not halted, not faulted.
    halted : Out(1)
        HALT retired.
    fault : Out(ProgramFlowFault())
        The fault that stopped the request (sticky until ``start``).
    pc : Out(16)
        Address of the next instruction to fetch.
    pos : Out(16)
        KV position of the current forward.
    in_idx : Out(16)
        Index of the current input token in the request (while ``token_is_drafted`` is 0).
    token_is_drafted : Out(1)
        The current forward's token is ``drafted_token`` rather than input ``in_idx``.
    drafted_token : Out(16)
        The current forward's token when it is a drafted one (set by NEXT).
    layer : Out(16)
        LAYER register (0 outside a loop).
    lstride : Out(32)
        LSTRIDE register (bytes between layer blocks).
    samples_now : Out(1)
        This forward must still sample a token (BRANCH ``no_sample`` is its negation).
    n_drafted : Out(8)
        SAMPLEs retired so far: tokens of a chain, levels of a tree (at most ``n_draft`` ≤
        MAX_DRAFT).
    forwards : Out(16)
        Forward steps completed (NEXT retired).
    tree_level : Out(range(MAX_DRAFT + 1))
        TREE_LEVEL: the level a tree forward feeds (0 in input forwards and chains).
    tree_forward : Out(1)
        This forward is a tree forward (``tree_level`` ≥ 1): its rows are the level's nodes.
    """

    def __init__(self):
        super().__init__(wiring.Signature({
            "start": In(stream.Signature(ProgramFlowStart())),
            "retire": In(stream.Signature(RetiredInstruction())),
            "running": Out(1),
            "halted": Out(1),
            "fault": Out(ProgramFlowFault()),
            "pc": Out(16),
            "pos": Out(16),
            "in_idx": Out(16),
            "token_is_drafted": Out(1),
            "drafted_token": Out(16),
            "layer": Out(16),
            "lstride": Out(32),
            "samples_now": Out(1),
            "n_drafted": Out(8),
            "forwards": Out(16),
            "tree_level": Out(range(MAX_DRAFT + 1)),
            "tree_forward": Out(1),
        }))

    def elaborate(self, platform):
        m = Module()
        n_tokens, n_draft = Signal(16), Signal(8)
        tree_width, tree_pc = Signal(8), Signal(16)
        in_loop, loop_start, loop_count = Signal(), Signal(16), Signal(16)
        sampled = Signal()              # this forward has sampled its token
        last_drafted = Signal(16)
        started = Signal()

        last_input = self.in_idx == n_tokens - 1
        m.d.comb += [
            self.samples_now.eq(last_input & (self.n_drafted < n_draft) & ~sampled),
            self.running.eq(started & ~self.halted & ~self.fault.valid),
            self.start.ready.eq(1),
            self.retire.ready.eq(self.running),
            self.tree_forward.eq(self.tree_level != 0),
        ]

        with m.If(self.start.valid & self.start.ready):
            p = self.start.payload
            m.d.sync += [
                started.eq(1), self.halted.eq(0), self.fault.eq(0),
                self.pc.eq(0), self.pos.eq(p.start_pos), self.in_idx.eq(0),
                self.token_is_drafted.eq(0), self.layer.eq(0), self.lstride.eq(0),
                in_loop.eq(0), self.n_drafted.eq(0), self.forwards.eq(0), sampled.eq(0),
                n_tokens.eq(p.n_tokens), n_draft.eq(p.n_draft), self.tree_level.eq(0),
                tree_width.eq(p.tree_width), tree_pc.eq(p.tree_pc),
            ]

        ins = self.retire.payload
        next_pc = self.pc + 1
        fault = Signal()

        def program_fault():
            m.d.comb += fault.eq(1)

        with m.If(self.retire.valid & self.retire.ready):
            with m.Switch(ins.opcode):
                with m.Case(Op.HALT):
                    m.d.sync += [self.halted.eq(1), self.pc.eq(next_pc)]
                with m.Case(Op.LOOP):
                    with m.If(in_loop | (ins.n == 0)):
                        program_fault()
                    with m.Else():
                        m.d.sync += [in_loop.eq(1), loop_start.eq(next_pc), loop_count.eq(ins.n),
                                     self.layer.eq(0), self.lstride.eq(ins.addr), self.pc.eq(next_pc)]
                with m.Case(Op.ENDLOOP):
                    with m.If(~in_loop):
                        program_fault()
                    with m.Elif(self.layer + 1 < loop_count):
                        m.d.sync += [self.layer.eq(self.layer + 1), self.pc.eq(loop_start)]
                    with m.Else():
                        m.d.sync += [in_loop.eq(0), self.layer.eq(0), self.pc.eq(next_pc)]
                with m.Case(Op.BRANCH):
                    taken = (ins.flags == Cond.ALWAYS) | ((ins.flags == Cond.NO_SAMPLE) & ~self.samples_now)
                    m.d.sync += self.pc.eq(Mux(taken, ins.n, next_pc))
                with m.Case(Op.NEXT):
                    with m.If(in_loop | self.samples_now):
                        program_fault()
                    with m.Else():
                        m.d.sync += [sampled.eq(0), self.forwards.eq(self.forwards + 1),
                                     self.pos.eq(self.pos + 1), self.pc.eq(next_pc)]
                        with m.If(~last_input):
                            m.d.sync += [self.in_idx.eq(self.in_idx + 1), self.pc.eq(ins.n)]
                        with m.Elif((self.n_drafted < n_draft) & (tree_width != 0)):
                            m.d.sync += [self.tree_level.eq(self.tree_level + 1), self.pc.eq(tree_pc)]
                        with m.Elif(self.n_drafted < n_draft):
                            m.d.sync += [self.token_is_drafted.eq(1), self.drafted_token.eq(last_drafted),
                                         self.pc.eq(ins.n)]
                with m.Case(Op.SAMPLE):
                    with m.If(~self.samples_now):
                        program_fault()
                    with m.Else():
                        m.d.sync += [self.n_drafted.eq(self.n_drafted + 1), sampled.eq(1),
                                     last_drafted.eq(ins.token), self.pc.eq(next_pc)]
                with m.Default():
                    m.d.sync += self.pc.eq(next_pc)
        with m.If(fault):
            m.d.sync += [self.fault.valid.eq(1), self.fault.code.eq(ErrorCode.PROGRAM),
                         self.fault.pc.eq(self.pc)]
        return m
