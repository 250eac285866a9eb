//! What a run reports: the Markdown tables, the JSON report, the comparison with an earlier
//! report and the SVG chart.

use serde_json::{json, Value};

use wgpu_attention::bench::Timer;
use wgpu_attention::{Context, Error, TuningSource};

use crate::cases::CaseResult;
use crate::cli::{Mask, Pass, PathKind};
use crate::problem::{mask_name, Problem};

pub(crate) fn print_table(results: &[CaseResult], peak: f64) {
    println!();
    println!("| pass | path | dtype | kernel | mask | B | H/Hkv | Lq | Lk | Dk/Dv | median ms | min-max ms | GFLOP/s | % of FMA peak | peak MiB | validation |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in results {
        let p = &r.problem;
        let head = format!(
            "| {} | {} | {} | {} | {} | {} | {}/{} | {} | {} | {}/{} |",
            r.pass.name(),
            r.path_label,
            p.dtype.name(),
            r.kernel,
            p.mask_label(),
            p.batch,
            p.heads,
            p.kv_heads,
            p.q_len,
            p.kv_len,
            p.dk,
            p.dv
        );
        match &r.outcome {
            Ok(m) => println!(
                "{head} {:.2} | {:.2}-{:.2} | {:.2} | {:.1}% | {:.2} | {} |",
                m.samples.median(),
                m.samples.min(),
                m.samples.max(),
                m.gflops,
                100.0 * m.gflops / peak,
                m.peak_bytes as f64 / (1024.0 * 1024.0),
                match &m.validation {
                    None => "not checked (size)".to_string(),
                    Some((true, ratio, _)) => format!("ok ({:.1}% of tol)", ratio * 100.0),
                    Some((false, ratio, _)) => format!("**FAILED** ({ratio:.1}x tol)"),
                }
            ),
            Err(e) => println!("{head} skipped: {e} | | | | | |"),
        }
    }
    // Fused vs unfused and backward vs forward, where both were measured.
    let find = |id: String| {
        results
            .iter()
            .find(|r| r.id == id)
            .and_then(|r| r.outcome.as_ref().ok())
            .map(|m| m.samples.median())
    };
    let mut lines = Vec::new();
    for r in results.iter().filter(|r| r.path == PathKind::Fused) {
        let label = r.problem.label();
        let pass = r.pass.name();
        let path = &r.path_label;
        let fused = find(format!("{pass} {path} {label}"));
        let unfused = find(format!("{pass} unfused {label}"));
        let ratio_bf = (r.pass == Pass::Backward)
            .then(|| {
                Some(
                    find(format!("backward {path} {label}"))?
                        / find(format!("forward {path} {label}"))?,
                )
            })
            .flatten();
        if let (Some(f), Some(u)) = (fused, unfused) {
            lines.push(format!(
                "| {pass} | {path} | {label} | {:.2}x | {} |",
                u / f,
                ratio_bf.map_or("".into(), |x| format!("{x:.2}"))
            ));
        } else if let Some(x) = ratio_bf {
            lines.push(format!("| {pass} | {path} | {label} | | {x:.2} |"));
        }
    }
    if !lines.is_empty() {
        println!(
            "\n| pass | path | problem | fused speed-up over unfused | fused backward / fused forward |"
        );
        println!("|---|---|---|---|---|");
        for l in lines {
            println!("{l}");
        }
    }
    // Packed against padded: the same sequences, `packed` against `varlen` masks.
    let mut packed = Vec::new();
    for r in results.iter().filter(|r| r.problem.packed()) {
        let padded_mask = match r.problem.mask {
            Mask::CausalPacked => Mask::CausalVarlen,
            _ => Mask::Varlen,
        };
        let padded = Problem {
            mask: padded_mask,
            ..r.problem.clone()
        };
        let (pass, path) = (r.pass.name(), &r.path_label);
        let times = (
            find(format!("{pass} {path} {}", r.problem.label())),
            find(format!("{pass} {path} {}", padded.label())),
        );
        if let (Some(p), Some(v)) = times {
            packed.push(format!(
                "| {pass} | {path} | {} | {:.2}x |",
                r.problem.label(),
                v / p
            ));
        }
    }
    if !packed.is_empty() {
        println!("\n| pass | path | problem | packed speed-up over padded (varlen) |");
        println!("|---|---|---|---|");
        for l in packed {
            println!("{l}");
        }
    }
    print_profiles(results);
}

/// With `--profile`: each fused case's compute passes by label, GPU ms and share of their sum.
fn print_profiles(results: &[CaseResult]) {
    let profiled: Vec<_> = results
        .iter()
        .filter_map(|r| r.outcome.as_ref().ok().map(|m| (r, &m.profile)))
        .filter(|(_, profile)| !profile.is_empty())
        .collect();
    if profiled.is_empty() {
        return;
    }
    println!(
        "\n| pass | path | problem | compute passes (one more run, GPU timestamps per pass) |"
    );
    println!("|---|---|---|---|");
    for (r, profile) in profiled {
        let total: f64 = profile.iter().map(|p| p.1).sum();
        let passes: Vec<String> = profile
            .iter()
            .map(|(label, ms, n)| {
                let count = if *n > 1 {
                    format!(" x{n}")
                } else {
                    String::new()
                };
                format!("{label}{count} {ms:.3} ms ({:.0}%)", 100.0 * ms / total)
            })
            .collect();
        println!(
            "| {} | {} | {} | {} |",
            r.pass.name(),
            r.path_label,
            r.problem.label(),
            passes.join(", ")
        );
    }
}

/// The checked-out revision, `-dirty` when the tree has uncommitted changes.
pub(crate) fn git_revision() -> String {
    std::process::Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

pub(crate) fn report_json(
    ctx: &Context,
    timer: &Timer,
    peak: f64,
    reps: usize,
    results: &[CaseResult],
) -> Value {
    let r = ctx.report();
    let l = &r.limits;
    let cases: Vec<Value> = results
        .iter()
        .map(|c| {
            let p = &c.problem;
            let mut v = json!({
                "id": c.id,
                "pass": c.pass.name(),
                "path": c.path_label,
                "kernel": c.kernel,
                "dtype": p.dtype.name(),
                "mask": mask_name(p.mask),
                "modifier": format!("{:?}", p.modifier).to_lowercase(),
                "window": p.window,
                "batch": p.batch, "heads": p.heads, "kv_heads": p.kv_heads,
                "q_len": p.q_len, "kv_len": p.kv_len,
                "head_dim_qk": p.dk, "head_dim_v": p.dv,
                "kv_lens": p.kv_lens(),
            });
            match &c.outcome {
                Ok(m) => {
                    v["times_ms"] = json!(m.samples.times_ms);
                    v["median_ms"] = json!(m.samples.median());
                    v["min_ms"] = json!(m.samples.min());
                    v["max_ms"] = json!(m.samples.max());
                    v["gflops"] = json!(m.gflops);
                    v["fraction_of_fma_peak"] = json!(m.gflops / peak);
                    v["peak_memory_bytes"] = json!(m.peak_bytes);
                    if !m.profile.is_empty() {
                        v["profile"] = m
                            .profile
                            .iter()
                            .map(|(label, ms, passes)| {
                                json!({"label": label, "ms": ms, "passes": passes})
                            })
                            .collect();
                    }
                    v["validation"] = match &m.validation {
                        None => json!({"checked": false}),
                        Some((passed, ratio, detail)) => json!({
                            "checked": true, "passed": passed,
                            "worst_ratio_to_tolerance": ratio, "worst": detail
                        }),
                    };
                }
                Err(e) => v["skipped"] = json!(e),
            }
            v
        })
        .collect();
    json!({
        "tool": "attention-bench",
        "version": env!("CARGO_PKG_VERSION"),
        "git_revision": git_revision(),
        "adapter": {
            "name": r.name,
            "backend": format!("{:?}", r.backend),
            "device_type": format!("{:?}", r.device_type),
            "driver": r.driver,
            "driver_info": r.driver_info,
            "features": format!("{:?}", r.features),
            "limits": {
                "max_compute_workgroup_storage_size": l.max_compute_workgroup_storage_size,
                "max_compute_invocations_per_workgroup": l.max_compute_invocations_per_workgroup,
                "max_storage_buffer_binding_size": l.max_storage_buffer_binding_size,
                "max_buffer_size": l.max_buffer_size,
                "max_storage_buffers_per_shader_stage": l.max_storage_buffers_per_shader_stage,
                "max_compute_workgroups_per_dimension": l.max_compute_workgroups_per_dimension,
            },
            "loop_budget": ctx.loop_budget(),
        },
        "qualifications": ctx.qualifications().iter().map(|q| json!({
            "kernel": q.kernel, "passed": q.passed, "detail": q.detail,
        })).collect::<Vec<_>>(),
        "tuning": ctx.tuning_report().iter().map(|t| json!({
            "key": t.key,
            "chosen": t.chosen.to_string(),
            "source": match &t.source {
                TuningSource::Tuned => "tuned".to_string(),
                TuningSource::Cache => "cache".to_string(),
                TuningSource::Static(why) => format!("static: {why}"),
                _ => format!("{:?}", t.source),
            },
            "seconds": t.seconds,
            "candidates": t.candidates.iter().map(|c| json!({
                "choice": c.choice.to_string(), "seconds": c.seconds, "verdict": c.verdict,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "clock": timer.clock().name(),
        "reps": reps,
        "fma_peak_gflops": peak,
        "cases": cases,
    })
}

pub(crate) fn read_json(path: &std::path::Path) -> wgpu_attention::Result<Value> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Device(format!("--compare {}: {e}", path.display())))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Device(format!("--compare {}: not a report: {e}", path.display())))
}

pub(crate) fn print_comparison(results: &[CaseResult], base: &Value) {
    let empty = Vec::new();
    let base_cases = base["cases"].as_array().unwrap_or(&empty);
    println!(
        "\nvs {} on {} (speed-up = base median / this median):",
        base["git_revision"].as_str().unwrap_or("?"),
        base["adapter"]["name"].as_str().unwrap_or("?")
    );
    println!("| case | base ms | this ms | speed-up |");
    println!("|---|---|---|---|");
    for r in results {
        let Ok(m) = &r.outcome else { continue };
        let base_ms = base_cases
            .iter()
            .find(|c| c["id"].as_str() == Some(r.id.as_str()))
            .and_then(|c| c["median_ms"].as_f64());
        match base_ms {
            Some(b) => println!(
                "| {} | {b:.2} | {:.2} | {:.2}x |",
                r.id,
                m.samples.median(),
                b / m.samples.median()
            ),
            None => println!("| {} | - | {:.2} | not in base |", r.id, m.samples.median()),
        }
    }
}

/// GFLOP/s against Lq (log2 axis), one line per (pass, path, mask) variant.
pub(crate) fn svg_plot(results: &[CaseResult]) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in results {
        if let Ok(m) = &r.outcome {
            let name = format!(
                "{} {} {}",
                r.pass.name(),
                r.path_label,
                r.problem.mask_label()
            );
            series
                .entry(name)
                .or_default()
                .push((r.problem.q_len as f64, m.gflops));
        }
    }
    let (w, h, left, right, top, bottom) = (760.0, 440.0, 70.0, 230.0, 30.0, 50.0);
    let points: Vec<(f64, f64)> = series.values().flatten().copied().collect();
    let x_min = points
        .iter()
        .map(|p| p.0.log2())
        .fold(f64::INFINITY, f64::min);
    let x_max = points
        .iter()
        .map(|p| p.0.log2())
        .fold(f64::NEG_INFINITY, f64::max);
    let y_max = points.iter().map(|p| p.1).fold(0.0, f64::max).max(1e-9) * 1.1;
    let x_span = (x_max - x_min).max(1.0);
    let px = |l: f64| left + (l.log2() - x_min) / x_span * (w - left - right);
    let py = |g: f64| h - bottom - g / y_max * (h - top - bottom);
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{left}" y="18" font-size="14">attention-bench: GFLOP/s vs sequence length</text>"#
    );
    let (x0, y0, x1, y1) = (left, h - bottom, w - right, top);
    let _ = writeln!(
        svg,
        r#"<path d="M{x0},{y1} L{x0},{y0} L{x1},{y0}" stroke="black" fill="none"/>"#
    );
    for i in 0..=4 {
        let g = y_max * i as f64 / 4.0;
        let y = py(g);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{g:.1}</text>"##,
            x0 - 6.0,
            y + 4.0
        );
    }
    let mut lengths: Vec<f64> = points.iter().map(|p| p.0).collect();
    lengths.sort_by(f64::total_cmp);
    lengths.dedup();
    for l in lengths {
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{l}</text>"#,
            px(l),
            y0 + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">Lq (log scale)</text>"#,
        (x0 + x1) / 2.0,
        h - 10.0
    );
    let colors = [
        "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
        "#bcbd22", "#17becf",
    ];
    for (i, (name, mut pts)) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = colors[i % colors.len()];
        let d: Vec<String> = pts
            .iter()
            .map(|&(l, g)| format!("{:.1},{:.1}", px(l), py(g)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            d.join(" ")
        );
        for &(l, g) in &pts {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"/>"#,
                px(l),
                py(g)
            );
        }
        let ly = top + 16.0 * i as f64;
        let _ = writeln!(
            svg,
            r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"/><text x="{}" y="{}">{name}</text>"#,
            x1 + 10.0,
            x1 + 30.0,
            x1 + 36.0,
            ly + 4.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}
