//! Mutations of valid inputs: byte-level ones for every format (bit flips,
//! interesting integers over header fields, truncation, cut, duplicated
//! and swapped ranges, splices with another seed) and token-level ones
//! for the text formats (numbers and strings replaced by edge values, lines
//! dropped, duplicated, swapped or taken from another seed).

/// A small deterministic generator (SplitMix64): every input is a function
/// of the run's seed, the target and its number, so a finding replays.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The generator for input `index` of `target` under `seed`.
    pub fn for_input(seed: u64, target: &str, index: u64) -> Self {
        let mut h = seed ^ 0x9e37_79b9_7f4a_7c15;
        for b in target.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        let mut rng = Rng(h ^ index.wrapping_mul(0xd1b5_4a32_d192_ed03));
        rng.next();
        rng
    }

    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    /// One element of `items`.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Integers that break size arithmetic, as little-endian bytes of each width.
const INTERESTING: [u64; 14] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
    1 << 40,
];

/// Numbers that configs and JSON files must refuse or survive.
const NUMBERS: [&str; 16] = [
    "0",
    "-1",
    "1",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "4294967296",
    "1e308",
    "-1e308",
    "1e-320",
    "nan",
    "inf",
    "-inf",
    "3.5",
    "65537",
    "1000000000",
];

/// Strings for string values.
const STRINGS: [&str; 12] = [
    "",
    " ",
    "../../../../../../etc/passwd",
    "/dev/zero",
    "/nonexistent/file",
    "cuda:99",
    "wgpu:0",
    "cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu,cpu",
    "\u{0}\u{1}\u{7f}",
    "ü∂ƒ©\u{202e}",
    "auto",
    "random",
];

/// A mutated copy of `seed` (`others`: the target's other seeds, for
/// splices); `text`: the format is text, token-level mutations apply.
pub fn mutate(rng: &mut Rng, seed: &[u8], others: &[Vec<u8>], text: bool) -> Vec<u8> {
    let mut data = seed.to_vec();
    let rounds = 1 + (rng.next().trailing_zeros() as usize).min(7);
    for _ in 0..rounds {
        if text && rng.chance(0.7) {
            text_mutation(rng, &mut data, others);
        } else {
            byte_mutation(rng, &mut data, others);
        }
    }
    data
}

/// An offset, biased towards the first 4 KiB (headers, tables) half the time.
fn offset(rng: &mut Rng, len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    if rng.chance(0.5) {
        rng.below(len.min(4096))
    } else {
        rng.below(len)
    }
}

fn byte_mutation(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    let len = data.len();
    match rng.below(9) {
        0 if len > 0 => {
            let at = offset(rng, len);
            data[at] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let at = offset(rng, len);
            data[at] = rng.next() as u8;
        }
        2 => {
            // An interesting integer of 1, 2, 4 or 8 bytes, over what is there.
            let width = *rng.pick(&[1usize, 2, 4, 8]);
            let mut value = *rng.pick(&INTERESTING);
            if rng.chance(0.3) {
                value = value.wrapping_add(rng.below(3) as u64).wrapping_sub(1);
            }
            let bytes = &value.to_le_bytes()[..width];
            let at = offset(rng, len.saturating_sub(width) + 1).min(len);
            let end = (at + width).min(len);
            data.splice(at..end, bytes.iter().copied());
        }
        3 => {
            let keep = offset(rng, len + 1);
            data.truncate(keep);
        }
        4 if len > 0 => {
            let at = offset(rng, len);
            let n = 1 + rng.below((len - at).min(256));
            data.drain(at..at + n);
        }
        5 if len > 0 => {
            // Duplicate a range (a repeated entry), sometimes many times.
            let at = offset(rng, len);
            let n = 1 + rng.below((len - at).min(512));
            let copy = data[at..at + n].to_vec();
            let times = if rng.chance(0.1) { 1 + rng.below(64) } else { 1 };
            for _ in 0..times {
                data.splice(at..at, copy.iter().copied());
            }
        }
        6 if len > 1 => {
            // Swap two ranges of the same length (reordered entries).
            let n = 1 + rng.below((len / 2).min(256));
            let a = rng.below(len - n + 1);
            let b = rng.below(len - n + 1);
            if a + n <= b || b + n <= a {
                for i in 0..n {
                    data.swap(a + i, b + i);
                }
            }
        }
        7 if !others.is_empty() => {
            // Splice: our head, another seed's tail.
            let other = rng.pick(others);
            let at = offset(rng, len + 1);
            let from = rng.below(other.len() + 1);
            data.truncate(at);
            data.extend_from_slice(&other[from..]);
        }
        _ if len > 0 => {
            let at = offset(rng, len);
            let n = 1 + rng.below(16);
            for _ in 0..n {
                data.insert(at, rng.next() as u8);
            }
        }
        _ => data.push(rng.next() as u8),
    }
}

/// Byte ranges of the numbers and of the quoted strings' contents in `text`.
fn tokens(text: &[u8]) -> (Vec<(usize, usize)>, Vec<(usize, usize)>) {
    let (mut numbers, mut strings) = (Vec::new(), Vec::new());
    let mut i = 0;
    while i < text.len() {
        let c = text[i];
        if c == b'"' {
            let start = i + 1;
            let mut j = start;
            while j < text.len() && text[j] != b'"' && text[j] != b'\n' {
                j += 1;
            }
            strings.push((start, j));
            i = j + 1;
        } else if c.is_ascii_digit() || (c == b'-' && text.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            let start = i;
            i += 1;
            while i < text.len() && (text[i].is_ascii_alphanumeric() || b".+-_".contains(&text[i])) {
                i += 1;
            }
            numbers.push((start, i));
        } else {
            i += 1;
        }
    }
    (numbers, strings)
}

/// Start and end (after the newline) of every line.
fn lines(text: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &c) in text.iter().enumerate() {
        if c == b'\n' {
            out.push((start, i + 1));
            start = i + 1;
        }
    }
    if start < text.len() {
        out.push((start, text.len()));
    }
    out
}

fn text_mutation(rng: &mut Rng, data: &mut Vec<u8>, others: &[Vec<u8>]) {
    let (numbers, strings) = tokens(data);
    let rows = lines(data);
    match rng.below(8) {
        0 | 1 if !numbers.is_empty() => {
            let (a, b) = *rng.pick(&numbers);
            let value = if rng.chance(0.2) {
                (rng.next() >> rng.below(64)).to_string()
            } else {
                rng.pick(&NUMBERS).to_string()
            };
            data.splice(a..b, value.bytes());
        }
        2 if !strings.is_empty() => {
            let (a, b) = *rng.pick(&strings);
            let value = if rng.chance(0.1) {
                "x".repeat(1 + rng.below(100_000))
            } else {
                rng.pick(&STRINGS).to_string()
            };
            data.splice(a..b, value.bytes());
        }
        3 if !rows.is_empty() => {
            let (a, b) = *rng.pick(&rows);
            data.drain(a..b);
        }
        4 if !rows.is_empty() => {
            let (a, b) = *rng.pick(&rows);
            let copy = data[a..b].to_vec();
            let times = if rng.chance(0.1) { 1 + rng.below(200) } else { 1 };
            for _ in 0..times {
                data.splice(b..b, copy.iter().copied());
            }
        }
        5 if rows.len() > 1 => {
            let (a0, a1) = *rng.pick(&rows);
            let (b0, b1) = *rng.pick(&rows);
            if a1 <= b0 {
                let (first, second) = (data[a0..a1].to_vec(), data[b0..b1].to_vec());
                data.splice(b0..b1, first);
                data.splice(a0..a1, second);
            }
        }
        6 if !others.is_empty() => {
            // A line from another seed, at a random line start.
            let other = rng.pick(others);
            let their = lines(other);
            if !their.is_empty() {
                let (a, b) = *rng.pick(&their);
                let mut line = other[a..b].to_vec();
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let at = rows.get(rng.below(rows.len() + 1)).map_or(data.len(), |r| r.0);
                data.splice(at..at, line);
            }
        }
        _ if !strings.is_empty() && !numbers.is_empty() => {
            // A number where a string was, or the reverse.
            if rng.chance(0.5) {
                let (a, b) = *rng.pick(&strings);
                data.splice(a - 1..(b + 1).min(data.len()), rng.pick(&NUMBERS).bytes());
            } else {
                let (a, b) = *rng.pick(&numbers);
                data.splice(a..b, format!("\"{}\"", rng.pick(&STRINGS)).into_bytes());
            }
        }
        _ => byte_mutation(rng, data, others),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_and_index_give_the_same_input_and_others_differ() {
        let seed = b"a = 1\nb = \"x\"\n[c]\nd = [1, 2]\n".to_vec();
        let make = |i| mutate(&mut Rng::for_input(7, "config", i), &seed, &[], true);
        assert_eq!(make(3), make(3));
        let distinct: std::collections::BTreeSet<Vec<u8>> = (0..200).map(make).collect();
        assert!(distinct.len() > 150, "only {} distinct inputs of 200", distinct.len());
        assert!(
            distinct.iter().any(|d| d.len() < seed.len()) && distinct.iter().any(|d| d.len() > seed.len())
        );
    }

    #[test]
    fn tokens_finds_numbers_and_string_contents() {
        let (numbers, strings) = tokens(b"x = -12\ny = \"ab\"\nz = 1.5e3\n");
        assert_eq!(numbers, vec![(4, 7), (21, 26)]);
        assert_eq!(strings, vec![(13, 15)]);
    }
}
