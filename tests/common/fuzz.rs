//! Mutations shared by the fuzzing tests: a small deterministic generator, byte-level
//! mutations and JSON value mutations.

use serde_json::Value;

/// SplitMix64: small, deterministic, good enough to pick mutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Integers that break parsers: zero, one, powers of two and their neighbours, maxima.
pub fn interesting_int(rng: &mut Rng, original: u64, width: usize) -> u64 {
    let max = if width >= 8 { u64::MAX } else { (1u64 << (8 * width)) - 1 };
    let v = match rng.below(14) {
        0 => 0,
        1 => 1,
        2 => max,
        3 => max - 1,
        4 => max / 2,
        5 => max / 2 + 1,
        6 => 1u64 << rng.below(8 * width),
        7 => (1u64 << rng.below(8 * width)).wrapping_sub(1),
        8 => original.wrapping_add(1),
        9 => original.wrapping_sub(1),
        10 => original.wrapping_mul(2),
        11 => original / 2,
        12 => 32 * rng.below(64) as u64,
        _ => *rng.pick(&[2, 3, 4, 7, 8, 16, 31, 33, 64, 255, 256, 576, 640, 1024, 65535, 65536]),
    };
    v & max
}

/// One generic byte-level mutation.
pub fn mutate_bytes(rng: &mut Rng, data: &mut Vec<u8>) {
    if data.is_empty() {
        data.push(rng.next() as u8);
        return;
    }
    let len = data.len();
    match rng.below(8) {
        0 => {
            for _ in 0..1 + rng.below(8) {
                let at = rng.below(len);
                data[at] ^= 1 << rng.below(8);
            }
        }
        1 => {
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(len);
                let random = rng.next() as u8;
                data[at] = *rng.pick(&[0, 1, 0x7F, 0x80, 0xFF, random]);
            }
        }
        2 | 3 => {
            let width = *rng.pick(&[2usize, 4, 8]);
            if len >= width {
                let at = rng.below(len - width + 1);
                let mut old = [0u8; 8];
                old[..width].copy_from_slice(&data[at..at + width]);
                let v = interesting_int(rng, u64::from_le_bytes(old), width);
                data[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
        }
        4 => data.truncate(rng.below(len)),
        5 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(4096));
            data.drain(at..at + n);
        }
        6 => {
            let at = rng.below(len);
            let n = 1 + rng.below((len - at).min(4096));
            let chunk = data[at..at + n].to_vec();
            let to = rng.below(len);
            data.splice(to..to, chunk);
        }
        _ => {
            let n = 1 + rng.below(64);
            let to = rng.below(len + 1);
            let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            data.splice(to..to, junk);
        }
    }
}

/// A mutation of a JSON document's values: numbers set to extremes, types changed, keys
/// removed, arrays grown or emptied, deep nesting.
pub fn mutate_json(rng: &mut Rng, value: &mut Value) {
    // Collect pointers to every node, pick one.
    fn paths(v: &Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    paths(child, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)
                }
            }
            Value::Array(xs) => {
                // Long arrays (vocabularies, shapes of many tensors): a sample of them.
                for i in (0..xs.len()).step_by((xs.len() / 64).max(1)) {
                    paths(&xs[i], format!("{at}/{i}"), out)
                }
            }
            _ => {}
        }
    }
    let mut all = Vec::new();
    paths(value, String::new(), &mut all);
    let path = rng.pick(&all).clone();
    let Some(node) = value.pointer_mut(&path) else { return };
    let numbers = [
        0.0,
        -1.0,
        1.0,
        2.0,
        3.0,
        0.5,
        -0.0,
        1e9,
        1e19,
        1e300,
        -1e300,
        4294967295.0,
        4294967296.0,
        9007199254740993.0,
        18446744073709551615.0,
    ];
    *node = match rng.below(12) {
        0 => Value::Null,
        1 => Value::Bool(rng.chance(0.5)),
        2 => serde_json::json!(*rng.pick(&numbers)),
        3 => serde_json::json!(interesting_int(rng, node.as_u64().unwrap_or(7), 8)),
        4 => serde_json::json!(-(interesting_int(rng, 3, 4) as i64)),
        5 => Value::String(String::new()),
        6 => Value::String("\u{0}\u{FFFD}é𝄞".repeat(1 + rng.below(4))),
        7 => Value::Array(vec![]),
        8 => Value::Object(Default::default()),
        9 => match node.take() {
            Value::Array(mut xs) if !xs.is_empty() => {
                let i = rng.below(xs.len());
                if rng.chance(0.5) {
                    xs.remove(i);
                } else {
                    let x = xs[i].clone();
                    xs.insert(i, x);
                }
                Value::Array(xs)
            }
            Value::Object(mut map) if !map.is_empty() => {
                let key = map.keys().nth(rng.below(map.len())).cloned().unwrap_or_default();
                map.remove(&key);
                Value::Object(map)
            }
            other => serde_json::json!([other]),
        },
        10 => {
            let mut v = node.take();
            for _ in 0..1 + rng.below(200) {
                v = Value::Array(vec![v]);
            }
            v
        }
        _ => match node {
            Value::Number(n) => serde_json::json!(n.as_f64().unwrap_or(0.0) * *rng.pick(&[-1.0, 2.0, 0.5, 1e6])),
            Value::String(s) => Value::String(format!("{s}{s}")),
            _ => Value::Null,
        },
    };
}

/// Mutates a JSON file: mostly through its values (it stays JSON), sometimes its bytes.
pub fn mutate_json_bytes(rng: &mut Rng, data: &[u8]) -> Vec<u8> {
    if rng.chance(0.7) {
        if let Ok(mut v) = serde_json::from_slice::<Value>(data) {
            for _ in 0..1 + rng.below(3) {
                mutate_json(rng, &mut v);
            }
            return serde_json::to_vec(&v).unwrap_or_default();
        }
    }
    let mut out = data.to_vec();
    for _ in 0..1 + rng.below(3) {
        mutate_bytes(rng, &mut out);
    }
    out
}
