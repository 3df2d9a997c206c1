//! Dequantisation of ggml tensor types to f32: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K,
//! Q6_K. Block layouts follow ggml's reference definitions (`ggml-common.h`,
//! `dequantize_row_*` in `ggml-quants.c`); scales are little-endian f16.

use half::{bf16, f16};

/// Values per block of the 32-value quantisations (Q4_0, Q4_1, Q8_0).
pub const QK32: usize = 32;
/// Values per super-block of the K-quantisations.
pub const QK_K: usize = 256;

fn f16_at(bytes: &[u8], offset: usize) -> f32 {
    f16::from_le_bytes([bytes[offset], bytes[offset + 1]]).to_f32()
}

/// F32: little-endian floats.
pub fn dequant_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16: little-endian IEEE half floats.
pub fn dequant_f16(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// BF16: little-endian bfloat16.
pub fn dequant_bf16(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Q8_0 (34 bytes per 32 values): f16 scale `d`, 32 signed bytes; `x = d * q`.
pub fn dequant_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(QK32)) {
        let d = f16_at(block, 0);
        for (o, &q) in y.iter_mut().zip(&block[2..34]) {
            *o = d * (q as i8) as f32;
        }
    }
}

/// Q4_0 (18 bytes per 32 values): f16 `d`, 16 bytes of nibbles; low nibbles are values 0..16,
/// high nibbles values 16..32; `x = d * (q - 8)`.
pub fn dequant_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(QK32)) {
        let d = f16_at(block, 0);
        for (j, &q) in block[2..18].iter().enumerate() {
            y[j] = d * ((q & 0x0F) as i32 - 8) as f32;
            y[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
        }
    }
}

/// Q4_1 (20 bytes per 32 values): f16 `d`, f16 `m`, 16 bytes of nibbles (as Q4_0);
/// `x = d * q + m`.
pub fn dequant_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(QK32)) {
        let d = f16_at(block, 0);
        let m = f16_at(block, 2);
        for (j, &q) in block[4..20].iter().enumerate() {
            y[j] = d * (q & 0x0F) as f32 + m;
            y[j + 16] = d * (q >> 4) as f32 + m;
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of Q4_K and
/// Q5_K (ggml's `get_scale_min_k4`).
fn scale_min_k4(j: usize, scales: &[u8]) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4),
            (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
        )
    }
}

/// Q4_K (144 bytes per 256 values): f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins for
/// 8 sub-blocks of 32, 128 bytes of nibbles. Each 32 bytes of nibbles hold two sub-blocks (low
/// nibbles first); `x = d * sc * q - dmin * m`.
pub fn dequant_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(144).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qs = &block[16..144];
        for chunk in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * chunk, scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
            let q = &qs[chunk * 32..chunk * 32 + 32];
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0F) as f32 - min1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - min2;
            }
        }
    }
}

/// Q5_K (176 bytes per 256 values): as Q4_K plus 32 bytes `qh` holding the fifth bit: bit
/// `2*chunk` of `qh[l]` for the low-nibble sub-block, bit `2*chunk+1` for the high one.
pub fn dequant_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(176).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qh = &block[16..48];
        let qs = &block[48..176];
        for chunk in 0..4 {
            let (sc1, m1) = scale_min_k4(2 * chunk, scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
            let (bit1, bit2) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            let q = &qs[chunk * 32..chunk * 32 + 32];
            let y = &mut y[chunk * 64..chunk * 64 + 64];
            for l in 0..32 {
                let hi1 = if qh[l] & bit1 != 0 { 16 } else { 0 };
                let hi2 = if qh[l] & bit2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((q[l] & 0x0F) + hi1) as f32 - min1;
                y[l + 32] = d2 * ((q[l] >> 4) + hi2) as f32 - min2;
            }
        }
    }
}

/// Q6_K (210 bytes per 256 values): 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2 bits),
/// 16 signed 8-bit scales (one per 16 values), f16 `d`; `x = d * scale * (q - 32)`.
pub fn dequant_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (block, y) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(block, 208);
        for half_block in 0..2 {
            let ql = &block[half_block * 64..half_block * 64 + 64];
            let qh = &block[128 + half_block * 32..128 + half_block * 32 + 32];
            let sc = &block[192 + half_block * 8..192 + half_block * 8 + 8];
            let y = &mut y[half_block * 128..half_block * 128 + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_and_q4_hand_blocks() {
        let mut b = f16b(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut y = [0f32; 32];
        dequant_q8_0(&b, &mut y);
        assert_eq!(y[0], -8.0);
        assert_eq!(y[31], 7.5);

        // Q4_0: byte j = (hi << 4) | lo; value j = lo, value j+16 = hi.
        let mut b = f16b(2.0).to_vec();
        b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        dequant_q4_0(&b, &mut y);
        assert_eq!(y[0], -16.0); // (0 - 8) * 2
        assert_eq!(y[15], 14.0); // (15 - 8) * 2
        assert_eq!(y[16], 14.0); // hi nibble of byte 0 is 15
        assert_eq!(y[31], -16.0);

        let mut b = f16b(0.25).to_vec();
        b.extend(f16b(-1.0));
        b.extend((0..16u8).map(|j| (15 - j) << 4 | j));
        dequant_q4_1(&b, &mut y);
        assert_eq!(y[1], -0.75);
        assert_eq!(y[16], 2.75);
    }

    #[test]
    fn k_scale_min_unpacking() {
        // Sub-blocks 0..4: low 6 bits of bytes 0..4 / 4..8. Sub-blocks 4..8: nibbles of bytes
        // 8..12 plus the top two bits of bytes 0..4 (scales) and 4..8 (mins).
        let scales = [0b11_000001, 2, 3, 4, 0b01_000101, 6, 7, 8, 0x9A, 0xBC, 0xDE, 0xF0];
        assert_eq!(scale_min_k4(0, &scales), (1, 5));
        assert_eq!(scale_min_k4(3, &scales), (4, 8));
        // j=4: scale = (0x9A & 0xF) | (3 << 4) = 0x3A; min = (0x9A >> 4) | (1 << 4) = 0x19.
        assert_eq!(scale_min_k4(4, &scales), (0x3A, 0x19));
        assert_eq!(scale_min_k4(7, &scales), (0x00, 0x0F));
    }
}
