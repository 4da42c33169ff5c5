"""PM4 packets: header encoding against independently known words, build -> decode round trips,
and the decoder's refusals, each naming the packet."""
import pytest

from qcom.cmdstream import (OPCODES, REGISTERS, SB6_CS_SHADER, SS6_INDIRECT, ST6_SHADER,
                            StreamError, decode, format_stream, lohi, odd_parity, pkt4, pkt7)

BUF = (0x1_0000_0000, 0x10000)  # one allocation: (gpuaddr, bytes)
A = BUF[0]


def op(name, *payload):
    return pkt7(OPCODES[name], *payload)


def reg(name, *values):
    return pkt4(REGISTERS[name], *values)


def load_shader(addr, units):
    return op("CP_LOAD_STATE6_FRAG", ST6_SHADER << 14 | SS6_INDIRECT << 16 | SB6_CS_SHADER << 18
              | units << 22, *lohi(addr))


def dispatch():
    return (op("CP_SET_MARKER", 8) + reg("SP_CS_OBJ_START_LO", *lohi(A)) + load_shader(A, 2)
            + reg("HLSQ_CS_NDRANGE_0", 1, 64, 0, 1, 0, 1, 0) + op("CP_EXEC_CS", 0, 1, 1, 1)
            + op("CP_EVENT_WRITE", 4, *lohi(A + 0x100), 7) + op("CP_WAIT_FOR_IDLE"))


def test_odd_parity_makes_the_ones_count_odd():
    for v in range(0, 1 << 12):
        assert (bin(v).count("1") + odd_parity(v)) % 2 == 1


def test_headers_match_known_words():
    assert op("CP_WAIT_FOR_IDLE") == [0x70268000]  # the word freedreno's dumps show
    assert pkt4(1, 5) == [0x40000101, 5]  # register 1, count 1: both already odd, no parity bit
    assert pkt4(3, 5, 6, 7)[0] == 0x48000383  # register 3 and count 3 each get a parity bit
    assert op("CP_SET_MARKER", 8)[0] == 0x70E50001


def test_round_trip_names_every_packet_in_order():
    packets = decode(dispatch(), [BUF])
    assert [p.name for p in packets] == ["CP_SET_MARKER", "SP_CS_OBJ_START_LO",
                                         "CP_LOAD_STATE6_FRAG", "HLSQ_CS_NDRANGE_0", "CP_EXEC_CS",
                                         "CP_EVENT_WRITE", "CP_WAIT_FOR_IDLE"]
    assert packets[3].payload == (1, 64, 0, 1, 0, 1, 0)
    text = format_stream(packets)
    assert "SP_CS_OBJ_START_HI = 0x1" in text and "HLSQ_CS_NDRANGE_1 = 0x40" in text


@pytest.mark.parametrize("bit", [7, 15, 23, 27])
def test_a_flipped_parity_bit_is_rejected_naming_the_packet(bit):
    words = dispatch()
    index = 4 if bit in (15, 23) else 1  # a type-7 (CP_EXEC_CS) or type-4 header
    at = [p.at for p in decode(words, [BUF])][index]
    words[at] ^= 1 << bit
    with pytest.raises(StreamError, match=rf"packet {index} \(dword {at}.*bad parity"):
        decode(words, [BUF])


def test_unknown_opcode_is_rejected():
    with pytest.raises(StreamError, match=r"packet 1 .*unknown type-7 opcode 0x7e"):
        decode(op("CP_WAIT_FOR_IDLE") + pkt7(0x7E), [BUF])


def test_unknown_register_is_rejected():
    with pytest.raises(StreamError, match=r"packet 0 .*register 0x1234"):
        decode(pkt4(0x1234, 0), [BUF])


def test_address_outside_every_allocation_is_rejected():
    words = op("CP_WAIT_FOR_IDLE") + load_shader(A + BUF[1] - 128, 2)  # one unit past the end
    with pytest.raises(StreamError, match=r"packet 1 .*CP_LOAD_STATE6_FRAG.*outside every"):
        decode(words, [BUF])
    decode(op("CP_WAIT_FOR_IDLE") + load_shader(A + BUF[1] - 256, 2), [BUF])


def test_address_register_outside_allocations_and_half_pairs_are_rejected():
    with pytest.raises(StreamError, match="SP_CS_IBO 0x5000.1 lies outside every"):
        decode(reg("SP_CS_IBO_LO", *lohi(0x5000)), [BUF])
    with pytest.raises(StreamError, match="only half of the address pair SP_CS_IBO"):
        decode(reg("SP_CS_IBO_LO", 0), [BUF])
    decode(reg("SP_CS_IBO_LO", 0, 0), [BUF])  # 0: unbound


def test_truncated_packet_and_wrong_payload_length_are_rejected():
    with pytest.raises(StreamError, match="run past the end"):
        decode(op("CP_EXEC_CS", 0, 1, 1, 1)[:3], [BUF])
    with pytest.raises(StreamError, match=r"CP_EXEC_CS\): payload of 3 words"):
        decode(op("CP_EXEC_CS", 0, 1, 1), [BUF])


def test_indirect_buffers_are_followed_one_level():
    inner = dispatch()
    mem = {A + 0x1000: inner}
    outer = op("CP_INDIRECT_BUFFER", *lohi(A + 0x1000), len(inner))
    packets = decode(outer, [BUF], lambda addr, n: mem[addr][:n])
    assert [p.ib for p in packets] == [0] + [1] * 7
    mem[A + 0x2000] = outer
    deeper = op("CP_INDIRECT_BUFFER", *lohi(A + 0x2000), len(outer))
    with pytest.raises(StreamError, match="deeper than the CP's IB2"):
        decode(deeper, [BUF], lambda addr, n: mem[addr][:n])


def test_builders_refuse_what_a_header_cannot_hold():
    with pytest.raises(ValueError):
        pkt4(0x40000, 1)
    with pytest.raises(ValueError):
        pkt4(REGISTERS["SP_CS_CONFIG"], *range(128))
    with pytest.raises(ValueError):
        pkt7(0x80)


def test_register_table_is_one_to_one_and_address_pairs_are_adjacent():
    assert len(set(REGISTERS.values())) == len(REGISTERS)
    for name, reg in REGISTERS.items():
        if name.endswith("_LO"):
            assert REGISTERS[name[:-3] + "_HI"] == reg + 1, name
