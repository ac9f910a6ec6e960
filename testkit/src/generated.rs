//! Checked-in files that are rendered from a source (the flag and metric references,
//! the PrometheusRule object): a test compares them, and `TETHER_BLESS=1` rewrites them.

use std::path::Path;

/// Compares the file at `path` with `rendered`; with `TETHER_BLESS=1` in the
/// environment writes it instead. `bless` is the command that rewrites it, for the
/// failure message.
pub fn check(path: &Path, rendered: &str, bless: &str) {
    if std::env::var_os("TETHER_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().expect("a file in a directory"))
            .expect("create the directory");
        std::fs::write(path, rendered).expect("write the rendered file");
        return;
    }
    let on_disk = std::fs::read_to_string(path).unwrap_or_default();
    if on_disk != rendered {
        let first = on_disk
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(on_disk.lines().count().min(rendered.lines().count()));
        panic!(
            "{} is not what its source renders (first difference at line {}: {:?} in the \
             file, {:?} rendered); run `{bless}` and commit the result",
            path.display(),
            first + 1,
            on_disk.lines().nth(first).unwrap_or("<end>"),
            rendered.lines().nth(first).unwrap_or("<end>"),
        );
    }
}
