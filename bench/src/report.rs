//! What a run prints and writes: the route table with its ratios to direct, the memory
//! figures, and the JSON file.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::route::Route;

/// Prints the table of medians (`table[route][metric]`) with each figure's ratio to
/// direct (the first route); returns the same as JSON, by metric and route.
pub(crate) fn print_table(
    rounds: usize,
    size_mib: u64,
    routes: &[Route],
    metrics: &[&str],
    table: &[Vec<f64>],
) -> Map<String, Value> {
    println!(
        "\nmedians of {} interleaved rounds, {} MiB transfers; (x) = ratio to direct",
        rounds, size_mib
    );
    print!("{:<22}", "");
    for r in routes {
        print!("{:>26}", r.name());
    }
    println!();
    let mut out = Map::new();
    for (mi, name) in metrics.iter().enumerate() {
        print!("{name:<22}");
        let direct = table[0][mi];
        let mut row = Map::new();
        for (ri, r) in routes.iter().enumerate() {
            let v = table[ri][mi];
            print!("{:>26}", format!("{v:.2} ({:.2}x)", v / direct));
            row.insert(
                r.name().into(),
                json!({"value": v, "ratio_to_direct": v / direct}),
            );
        }
        println!();
        out.insert((*name).into(), Value::Object(row));
    }
    out
}

fn mib(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// Prints the memory figures `memory::memory` measured.
pub(crate) fn print_memory(mem: &Value) {
    println!("\nresident memory (MiB), grpc/uds server and agent, two rounds:");
    for round in mem.as_array().unwrap() {
        for p in round.as_array().unwrap() {
            println!(
                "  tunnels {:>8}: server {:>6.1} (heap+stacks {:>5.1})  agent {:>6.1} (heap+stacks {:>5.1})",
                p["tunnels"].to_string(),
                mib(&p["server_mib"]),
                mib(&p["server_anon_mib"]),
                mib(&p["agent_mib"]),
                mib(&p["agent_anon_mib"]),
            );
        }
    }
}

/// Writes `v` to `path` as pretty JSON.
pub(crate) fn write_json(path: &Path, v: &Value) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)?)?;
    Ok(())
}

/// Prints `v` as pretty JSON and writes it to `path` (the soak and swarm runs).
pub(crate) fn print_and_write_json(path: &Path, v: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    write_json(path, v)
}
