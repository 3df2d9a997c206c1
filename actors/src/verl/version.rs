//! The VeRL releases whose config `grpo verl` knows, and which one a command line was written for.
//!
//! VeRL changed its config's layout in 0.7.1: the reward settings moved from `reward_model.*`,
//! `reward_manager.*` and a top-level `custom_reward_function` to one `reward` section, and
//! Megatron, VeOmni and TorchTitan became `model_engine` choices. Each [`VerlVersion`] holds the
//! defaults of one commit, per engine (`defaults/COMMIT8-ENGINE.tsv`, written by
//! `make_defaults.py`). A command line is checked against the one it names (`--verl-version`) or
//! the one its keys belong to ([`detect`]).

use serde_json::Value;
use std::collections::BTreeMap;

/// One VeRL commit's config: its defaults for each training engine.
#[derive(Debug)]
pub struct VerlVersion {
    /// The commit the defaults were read at.
    pub commit: &'static str,
    /// The commit's date.
    pub date: &'static str,
    /// The releases whose layout this commit's config has, in words.
    pub releases: &'static str,
    /// `(model_engine, defaults TSV)`; the first is VeRL's default engine.
    engines: &'static [(&'static str, &'static str)],
}

/// Newest first; the first is what a command line is read as when nothing says otherwise.
pub const VERSIONS: &[VerlVersion] = &[
    VerlVersion {
        commit: "1dda039b9c6311889a9c9a26040677e1254814f9",
        date: "2026-08-22",
        releases: "VeRL 0.7.1 and later",
        engines: &[
            ("dp", include_str!("defaults/1dda039b-dp.tsv")),
            ("megatron", include_str!("defaults/1dda039b-megatron.tsv")),
            ("veomni", include_str!("defaults/1dda039b-veomni.tsv")),
            ("torchtitan", include_str!("defaults/1dda039b-torchtitan.tsv")),
        ],
    },
    VerlVersion {
        commit: "b178a3cd56f58b2d502255daba591e92833930a7",
        date: "2026-01-29",
        releases: "VeRL 0.7.0 and earlier",
        engines: &[
            ("dp", include_str!("defaults/b178a3cd-dp.tsv")),
            ("megatron", include_str!("defaults/b178a3cd-megatron.tsv")),
        ],
    },
];

impl VerlVersion {
    /// The newest layout.
    pub fn current() -> &'static VerlVersion {
        &VERSIONS[0]
    }

    /// Whether this layout has VeRL 0.7.1's `reward` section (else `reward_model`,
    /// `reward_manager` and `custom_reward_function` at the top).
    pub fn has_reward_section(&self) -> bool {
        self.engines
            .first()
            .is_some_and(|(_, tsv)| tsv.contains("\nreward.num_workers\t"))
    }

    /// `RELEASES (config of COMMIT8, DATE)`, for notes and errors.
    pub fn describe(&self) -> String {
        format!(
            "{} (config of {}, {})",
            self.releases,
            &self.commit[..8],
            self.date
        )
    }

    /// The engines (`model_engine` values) this version has.
    pub fn engines(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.engines.iter().map(|(name, _)| *name)
    }

    /// The defaults of `engine`, leaf by leaf; None when this version has no such engine.
    pub fn defaults(&self, engine: &str) -> Option<BTreeMap<String, Value>> {
        let (_, tsv) = self.engines.iter().find(|(name, _)| *name == engine)?;
        Some(parse_tsv(tsv))
    }

    /// Every key of every engine of this version.
    pub fn all_keys(&self) -> std::collections::BTreeSet<String> {
        self.engines
            .iter()
            .flat_map(|(_, tsv)| parse_tsv(tsv).into_keys())
            .collect()
    }

    /// `--verl-version`: a release number (`0.7.0`, `0.9.1`) or a commit prefix of one of
    /// [`VERSIONS`].
    pub fn parse(text: &str) -> Result<&'static VerlVersion, String> {
        let text = text.trim().trim_start_matches('v');
        if let Some(v) = VERSIONS
            .iter()
            .find(|v| text.len() >= 7 && v.commit.starts_with(&text.to_ascii_lowercase()))
        {
            return Ok(v);
        }
        let release: Option<Vec<u64>> = text.split('.').map(|p| p.parse().ok()).collect();
        match release.as_deref() {
            Some([major, minor, rest @ ..]) if rest.len() <= 1 => {
                let patch = rest.first().copied().unwrap_or(0);
                let before_reward_section = (*major, *minor, patch) < (0, 7, 1);
                Ok(if before_reward_section {
                    &VERSIONS[1]
                } else {
                    &VERSIONS[0]
                })
            }
            _ => Err(format!(
                "`{text}` is not a VeRL release (such as 0.7.0 or 0.9.1) or one of the commits \
                 grpo knows ({})",
                VERSIONS
                    .iter()
                    .map(|v| format!("{}: {}", &v.commit[..8], v.releases))
                    .collect::<Vec<_>>()
                    .join("; ")
            )),
        }
    }
}

fn parse_tsv(tsv: &str) -> BTreeMap<String, Value> {
    tsv.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.split_once('\t').expect("defaults TSV: key<TAB>json");
            (
                key.to_string(),
                serde_json::from_str(value).expect("defaults TSV: json"),
            )
        })
        .collect()
}

/// Which version a command line was written for, and why (for the note): the version holding
/// every key it sets that only one version has. Keys both have decide nothing; with none that
/// decides, the newest. Keys of both is an error naming one of each.
pub fn detect<'k>(keys: impl IntoIterator<Item = &'k str>) -> Result<(&'static VerlVersion, String), String> {
    let known: Vec<_> = VERSIONS.iter().map(|v| (v, v.all_keys())).collect();
    let has = |set: &std::collections::BTreeSet<String>, key: &str| {
        let section = format!("{key}.");
        set.contains(key)
            || set
                .range(section.clone()..)
                .next()
                .is_some_and(|k| k.starts_with(&section))
    };
    let mut evidence: Vec<Option<&str>> = vec![None; VERSIONS.len()];
    for key in keys {
        let holders: Vec<usize> = (0..known.len()).filter(|&i| has(&known[i].1, key)).collect();
        if let [only] = holders[..] {
            evidence[only].get_or_insert(key);
        }
    }
    let found: Vec<(usize, &str)> = evidence
        .iter()
        .enumerate()
        .filter_map(|(i, k)| k.map(|k| (i, k)))
        .collect();
    match found[..] {
        [] => Ok((
            VerlVersion::current(),
            "no key of the command line belongs to one layout only".to_string(),
        )),
        [(i, key)] => Ok((&VERSIONS[i], format!("`{key}` is a key of this layout only"))),
        [(a, ka), (b, kb), ..] => Err(format!(
            "the command line mixes VeRL's layouts: `{ka}` is a key of {} only, `{kb}` of {} \
             only; write it for one of them (VeRL 0.7.1 moved `reward_model.*`, \
             `reward_manager.*` and `custom_reward_function.*` under `reward.*`), or name one \
             with --verl-version",
            VERSIONS[a].describe(),
            VERSIONS[b].describe()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_and_commits_name_a_version() {
        let commit = |s: &str| &VerlVersion::parse(s).unwrap().commit[..8];
        assert_eq!(commit("0.7.0"), "b178a3cd");
        assert_eq!(commit("0.6"), "b178a3cd");
        assert_eq!(commit("0.7.1"), "1dda039b");
        assert_eq!(commit("v0.9.1"), "1dda039b");
        assert_eq!(commit("0.10"), "1dda039b");
        assert_eq!(commit("b178a3cd"), "b178a3cd");
        assert_eq!(commit("1dda039b9c63"), "1dda039b");
        let err = VerlVersion::parse("latest").unwrap_err();
        assert!(err.contains("b178a3cd: VeRL 0.7.0 and earlier"), "{err}");
    }

    #[test]
    fn the_keys_tell_the_layout() {
        let old = detect(["data.train_batch_size", "reward_manager.name"]).unwrap();
        assert_eq!(&old.0.commit[..8], "b178a3cd");
        assert!(old.1.contains("`reward_manager.name`"), "{}", old.1);
        let new = detect(["reward.num_workers", "data.train_batch_size"]).unwrap();
        assert_eq!(&new.0.commit[..8], "1dda039b");
        // Keys both layouts have (the legacy reward keys VeRL 0.7.1 still reads) decide nothing.
        let either = detect(["custom_reward_function.path", "reward_model.reward_manager"]).unwrap();
        assert_eq!(&either.0.commit[..8], "1dda039b");
        let err = detect(["reward_manager.name", "reward.num_workers"]).unwrap_err();
        assert!(err.contains("mixes VeRL's layouts"), "{err}");
    }
}
