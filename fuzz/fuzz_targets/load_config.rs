//! Fuzzes the whole configuration loader: YAML parsing, the schema walk, the
//! cross-file merge and the cross-scaler checks.
//!
//! The input is split on NUL bytes (which YAML text never contains) into a
//! main document and up to 3 drop-ins, so the fuzzer explores the merge as
//! well as single files. Any panic is a bug; so is a failed load that reports
//! no error, or a loaded config that differs from itself.

#![no_main]

use libfuzzer_sys::fuzz_target;

const NAMES: [&str; 4] = [
    "scalers.yaml",
    "scalers.d/01.yaml",
    "scalers.d/02.yaml",
    "scalers.d/03.yaml",
];

fuzz_target!(|data: &[u8]| {
    // Lossy: invalid UTF-8 is rejected before load_documents by `load`, so
    // spending fuzz time on it here would find nothing.
    let text = String::from_utf8_lossy(data);
    let docs: Vec<(&str, &str)> = NAMES.iter().copied().zip(text.splitn(4, '\0')).collect();
    match kici_config::load_documents(&docs) {
        Ok(loaded) => {
            assert_eq!(loaded.files.len(), docs.len());
            for warning in &loaded.warnings {
                let _ = warning.to_string();
            }
            assert!(
                kici_config::diff(&loaded.config, &loaded.config).is_empty(),
                "a config differs from itself"
            );
        }
        Err(errors) => {
            assert!(!errors.is_empty(), "a failed load reported no error");
            assert!(errors.to_string().lines().count() >= errors.len());
        }
    }
});
