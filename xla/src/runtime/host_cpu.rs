//! The host CPU as the CPU plugin sees it: its model name and feature flags (Linux
//! `/proc/cpuinfo`), and whether it has instructions that compute bf16 products natively.
//!
//! XLA CPU lowers bf16 matrix products to AVX512-BF16 / AMX-BF16 (x86) or BF16 (Arm)
//! instructions where the CPU has them; elsewhere it converts to f32 and back around every
//! product, which is slower than computing in f32 throughout (BENCHMARKS.md, "Compute type").

use std::sync::OnceLock;

/// The flags that give native bf16 products, with the names people know them by.
const BF16_FLAGS: [(&str, &str); 3] = [
    ("avx512_bf16", "AVX512-BF16"),
    ("amx_bf16", "AMX-BF16"),
    ("bf16", "Arm BF16"),
];

/// Wider vector flags named in the explanation when no bf16 flag is present, so a reader sees
/// what the CPU does have.
const VECTOR_FLAGS: [(&str, &str); 4] = [
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("asimd", "NEON"),
    ("sve", "SVE"),
];

/// What `/proc/cpuinfo` says of the first CPU: its model name and feature flags.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostCpu {
    /// `model name` (x86) or empty where the file does not give one.
    pub name: String,
    /// The `flags` (x86) or `Features` (Arm) of the first processor, sorted.
    pub flags: Vec<String>,
}

impl HostCpu {
    /// This machine's CPU, read once per process.
    pub fn get() -> &'static HostCpu {
        static CPU: OnceLock<HostCpu> = OnceLock::new();
        CPU.get_or_init(|| HostCpu::parse(&std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default()))
    }

    /// Parses the text of `/proc/cpuinfo`.
    pub fn parse(cpuinfo: &str) -> HostCpu {
        let field = |names: &[&str]| {
            cpuinfo
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(key, _)| names.contains(&key.trim()))
                .map(|(_, value)| value.trim().to_string())
        };
        let mut flags: Vec<String> = field(&["flags", "Features"])
            .map(|v| v.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default();
        flags.sort_unstable();
        flags.dedup();
        HostCpu {
            name: field(&["model name", "Model name"]).unwrap_or_default(),
            flags,
        }
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.binary_search_by(|f| f.as_str().cmp(flag)).is_ok()
    }

    /// Whether this CPU computes bf16 products natively, and why, in words naming the
    /// features found: `this CPU (AMD EPYC) has AVX512-BF16`, or `this CPU (AMD EPYC) has no
    /// bf16 instructions (AVX512-BF16, AMX-BF16 or Arm BF16), only AVX2`.
    pub fn bf16_support(&self) -> (bool, String) {
        let name = if self.name.is_empty() {
            "this CPU".to_string()
        } else {
            format!("this CPU ({})", self.name)
        };
        let found: Vec<&str> = BF16_FLAGS
            .iter()
            .filter(|(flag, _)| self.has(flag))
            .map(|(_, label)| *label)
            .collect();
        if !found.is_empty() {
            return (true, format!("{name} has {}", found.join(" and ")));
        }
        let wanted = BF16_FLAGS.map(|(_, label)| label);
        let vectors: Vec<&str> = VECTOR_FLAGS
            .iter()
            .filter(|(flag, _)| self.has(flag))
            .map(|(_, label)| *label)
            .collect();
        let has = if vectors.is_empty() {
            String::new()
        } else {
            format!(", only {}", vectors.join(" and "))
        };
        let reason = format!(
            "{name} has no bf16 instructions ({}, {} or {}){has}, so bf16 would be emulated, \
             slower than f32",
            wanted[0], wanted[1], wanted[2]
        );
        (false, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AVX2: &str = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n\
                        flags\t\t: fpu sse2 avx2 fma\nprocessor\t: 1\nflags\t\t: fpu\n";
    const AVX512_BF16: &str = "model name\t: AMD EPYC 9B14\nflags\t\t: avx2 avx512f avx512_bf16\n";
    const GRAVITON3: &str = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n";

    #[test]
    fn reads_the_first_processor() {
        let cpu = HostCpu::parse(AVX2);
        assert_eq!(cpu.name, "AMD EPYC");
        assert_eq!(cpu.flags, ["avx2", "fma", "fpu", "sse2"]);
        assert_eq!(HostCpu::parse(""), HostCpu::default());
    }

    #[test]
    fn names_the_features_that_decide_bf16() {
        assert_eq!(
            HostCpu::parse(AVX2).bf16_support(),
            (
                false,
                "this CPU (AMD EPYC) has no bf16 instructions (AVX512-BF16, AMX-BF16 or Arm \
                 BF16), only AVX2, so bf16 would be emulated, slower than f32"
                    .to_string()
            )
        );
        assert_eq!(
            HostCpu::parse(AVX512_BF16).bf16_support(),
            (true, "this CPU (AMD EPYC 9B14) has AVX512-BF16".to_string())
        );
        assert_eq!(
            HostCpu::parse(GRAVITON3).bf16_support(),
            (true, "this CPU has Arm BF16".to_string())
        );
        let (native, reason) = HostCpu::parse("").bf16_support();
        assert!(!native);
        assert!(
            reason.starts_with("this CPU has no bf16 instructions"),
            "{reason}"
        );
    }
}
