//! `tether rollout agents`: a new agent image on every node, with the new agent
//! connected before the old one drains, where the DaemonSet itself cannot surge
//! (Kubernetes before 1.22). A surge DaemonSet beside the old one, then the old one made
//! again from it; every step resumes where an interrupted run left off.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::Api;

use super::duration;

/// The label that keeps the surge DaemonSet's pods apart from the original's.
const SET_LABEL: &str = "tether.dev/agent-set";
/// On the surge DaemonSet: the DaemonSet it stands in for.
const SURGE_FOR: &str = "tether.dev/surge-for";
/// On the surge DaemonSet: the original's labels and annotations (JSON), which the
/// surge itself does not carry (a pruning `kubectl apply` or GitOps controller would
/// take it for theirs).
const ORIGINAL_METADATA: &str = "tether.dev/original-metadata";
/// The DaemonSet controller's own annotation: a new DaemonSet starts its own count.
const TEMPLATE_GENERATION: &str = "deprecated.daemonset.template.generation";

/// What the DaemonSets are made with: their fields' manager is `tether`.
fn create_params() -> PostParams {
    PostParams {
        field_manager: Some("tether".into()),
        ..Default::default()
    }
}

/// What to roll out.
#[derive(clap::Subcommand, Debug)]
pub enum RolloutCommand {
    /// Move the agent DaemonSet to a new image with no gap on any node.
    ///
    /// For clusters whose DaemonSets cannot surge (before 1.22; from 1.22 the shipped
    /// `maxSurge: 1` does this by itself). Makes `<daemonset>-surge`, a copy with the
    /// new image, waits until its agent is ready on every node, deletes the original
    /// (its agents drain: new dials go to the new ones, their open tunnels run to
    /// --drain-timeout), makes the original again with the new image, waits for it,
    /// and deletes the copy the same way. The DaemonSet ends as it began, name,
    /// selector and annotations, with the new image. Run it again after an
    /// interruption: it resumes. Tether only.
    Agents(AgentsArgs),
}

/// `tether rollout agents` flags.
#[derive(clap::Args, Debug)]
pub struct AgentsArgs {
    /// The new image for the agent container.
    #[arg(long)]
    pub image: String,
    /// The agent DaemonSet.
    #[arg(long, default_value = "konnectivity-agent")]
    pub daemonset: String,
    /// Its namespace.
    #[arg(long, short = 'n', default_value = "kube-system")]
    pub namespace: String,
    /// The container to change; needed only when the pod has several.
    #[arg(long)]
    pub container: Option<String>,
    /// The kubeconfig to use; in-cluster configuration when empty.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Give up (leaving every agent that runs running) after this long.
    #[arg(long, default_value = "10m", value_parser = duration)]
    pub timeout: Duration,
}

/// Runs the subcommand.
pub fn main(command: RolloutCommand) -> anyhow::Result<()> {
    let RolloutCommand::Agents(args) = command;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?
        .block_on(agents(&args))
}

/// Where a rollout stands, read from the two DaemonSets.
#[derive(Debug, PartialEq)]
enum Step {
    /// The original already runs the image and no copy is left.
    Done,
    /// Make the copy with the new image.
    MakeSurge,
    /// Wait for the copy on every node of the original, then delete the original.
    ReplaceOriginal,
    /// The original is being deleted: wait for it to go.
    AwaitOriginalGone,
    /// Make the original again from the copy.
    MakeOriginal,
    /// Wait for the original on every node of the copy, then delete the copy.
    RetireSurge,
    /// The copy is being deleted: wait for it to go.
    AwaitSurgeGone,
}

/// The next step, or why none can be taken.
fn step(
    original: Option<&DaemonSet>,
    surge: Option<&DaemonSet>,
    args: &AgentsArgs,
) -> anyhow::Result<Step> {
    let deleting = |d: &DaemonSet| d.metadata.deletion_timestamp.is_some();
    let has_image = |d: &DaemonSet| image(d, args.container.as_deref()).ok() == Some(&args.image);
    let surge_name = format!("{}-surge", args.daemonset);
    if let Some(s) = surge {
        check_surge(s, &surge_name, args)?;
    }
    if let Some(owners) = original.and_then(|o| o.metadata.owner_references.as_ref()) {
        if let Some(owner) = owners.iter().find(|o| o.controller == Some(true)) {
            bail!(
                "daemonset/{} belongs to {}/{}: change its image through its owner",
                args.daemonset,
                owner.kind,
                owner.name
            );
        }
    }
    Ok(match (original, surge) {
        (None, None) => bail!(
            "no daemonset/{} in namespace {}: give the agent DaemonSet with --daemonset and --namespace",
            args.daemonset,
            args.namespace
        ),
        (Some(o), None) if has_image(o) && !deleting(o) => Step::Done,
        // An original being deleted: its copy at once.
        (Some(_), None) => Step::MakeSurge,
        (Some(o), Some(s)) if deleting(s) && has_image(o) => Step::AwaitSurgeGone,
        (Some(_), Some(s)) if deleting(s) => bail!(
            "daemonset/{surge_name} is being deleted before daemonset/{} runs {}: wait for it to go and run again",
            args.daemonset,
            args.image
        ),
        (_, Some(s)) if !has_image(s) => {
            let other = image(s, args.container.as_deref())?;
            bail!(
                "daemonset/{surge_name} runs {other}: a rollout to that image was interrupted; run again with --image {other} to finish it first"
            )
        }
        (Some(o), Some(_)) if deleting(o) => Step::AwaitOriginalGone,
        (Some(o), Some(_)) if has_image(o) => Step::RetireSurge,
        (Some(_), Some(_)) => Step::ReplaceOriginal,
        // Even a copy being deleted: the original at once.
        (None, Some(_)) => Step::MakeOriginal,
    })
}

/// A copy this tool made for this DaemonSet and nobody changed since: only then does
/// its spec become the original's.
fn check_surge(s: &DaemonSet, name: &str, args: &AgentsArgs) -> anyhow::Result<()> {
    let made_for = s
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SURGE_FOR));
    if made_for != Some(&args.daemonset) {
        bail!(
            "daemonset/{name} was not made by tether rollout for daemonset/{}: delete it (without --cascade=orphan) or give another --daemonset",
            args.daemonset
        );
    }
    // Deleting a DaemonSet in the foreground counts one generation more.
    let made = 1 + i64::from(s.metadata.deletion_timestamp.is_some());
    let generation = s.metadata.generation.unwrap_or(1);
    if generation > made {
        bail!(
            "daemonset/{name} was changed after tether rollout made it (generation {generation}): look at the change, then delete it (without --cascade=orphan) to start again"
        );
    }
    Ok(())
}

/// The rollout, from wherever it stands to its end.
async fn agents(args: &AgentsArgs) -> anyhow::Result<()> {
    let client = tether_ops::kubeclient::client(args.kubeconfig.as_deref()).await?;
    let k = Kube {
        sets: Api::namespaced(client.clone(), &args.namespace),
        pods: Api::namespaced(client, &args.namespace),
        deadline: Instant::now() + args.timeout,
    };
    let (name, surge_name) = (args.daemonset.as_str(), format!("{}-surge", args.daemonset));
    loop {
        let original = k.sets.get_opt(name).await?;
        let surge = k.sets.get_opt(&surge_name).await?;
        match step(original.as_ref(), surge.as_ref(), args)? {
            Step::Done => {
                let o = original.expect("the step has it");
                k.ready(&o, &o, "it has the image already: look at its pods")
                    .await?;
                println!("daemonset/{name} runs {} on every node", args.image);
                return Ok(());
            }
            Step::MakeSurge => {
                let o = original.expect("the step has it");
                k.create(&surge_of(&o, &surge_name, args)?).await?;
            }
            Step::ReplaceOriginal => {
                let (o, s) = (original.expect("has it"), surge.expect("has it"));
                let abandon = format!(
                    "nothing was deleted and daemonset/{name} serves on: run again to resume, or delete daemonset/{surge_name} (without --cascade=orphan) to abandon"
                );
                k.ready(&s, &o, &abandon).await?;
                k.retire(&o).await?;
            }
            Step::AwaitOriginalGone => k.gone(name).await?,
            Step::MakeOriginal => {
                let s = surge.expect("the step has it");
                k.create(&original_of(&s, name, args)?).await?;
            }
            Step::RetireSurge => {
                let (o, s) = (original.expect("has it"), surge.expect("has it"));
                let resume =
                    format!("daemonset/{surge_name} serves on beside it: run again to resume");
                k.ready(&o, &s, &resume).await?;
                k.retire(&s).await?;
            }
            Step::AwaitSurgeGone => k.gone(&surge_name).await?,
        }
    }
}

/// The image of the agent container (`container`, or the pod's only one).
fn image<'a>(d: &'a DaemonSet, container: Option<&str>) -> anyhow::Result<&'a str> {
    let containers = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers.as_slice())
        .unwrap_or_default();
    let found = match container {
        Some(name) => containers.iter().find(|c| c.name == name),
        None if containers.len() == 1 => containers.first(),
        None => bail!(
            "the pod has {} containers ({}): name the agent's with --container",
            containers.len(),
            containers
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    match (found.and_then(|c| c.image.as_deref()), container) {
        (Some(image), _) => Ok(image),
        (None, Some(name)) => bail!("the pod has no container {name} with an image"),
        (None, None) => bail!("the pod has no container with an image"),
    }
}

/// `spec` with `image` on the agent container (`container`, or the pod's only one).
fn set_image(
    spec: &mut k8s_openapi::api::apps::v1::DaemonSetSpec,
    args: &AgentsArgs,
) -> anyhow::Result<()> {
    let pod = spec
        .template
        .spec
        .as_mut()
        .context("the DaemonSet has no pod")?;
    let only = pod.containers.len() == 1;
    for c in &mut pod.containers {
        if only || Some(c.name.as_str()) == args.container.as_deref() {
            c.image = Some(args.image.clone());
        }
    }
    Ok(())
}

/// The label `SET_LABEL` in a selector and the pod template's labels: set to `value`,
/// or removed.
fn mark(spec: &mut k8s_openapi::api::apps::v1::DaemonSetSpec, value: Option<&str>) {
    let selector = spec.selector.match_labels.get_or_insert_with(BTreeMap::new);
    let template = spec
        .template
        .metadata
        .get_or_insert_with(Default::default)
        .labels
        .get_or_insert_with(BTreeMap::new);
    for labels in [selector, template] {
        match value {
            Some(v) => labels.insert(SET_LABEL.into(), v.into()),
            None => labels.remove(SET_LABEL),
        };
    }
}

/// The original's labels and annotations, kept on the copy.
#[derive(serde::Serialize, serde::Deserialize, Default)]
struct Metadata {
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
}

/// The copy: the original's spec with the new image and a label of its own on its
/// selector and pods (the original's selector still matches those pods: only their
/// owner references keep the two apart). Its own labels are the selector's; the
/// original's labels and annotations ride in one annotation.
fn surge_of(original: &DaemonSet, name: &str, args: &AgentsArgs) -> anyhow::Result<DaemonSet> {
    image(original, args.container.as_deref())?;
    let mut spec = original.spec.clone().context("the DaemonSet has no spec")?;
    set_image(&mut spec, args)?;
    mark(&mut spec, Some("surge"));
    let mut annotations = original.metadata.annotations.clone();
    if let Some(a) = annotations.as_mut() {
        a.remove(TEMPLATE_GENERATION);
    }
    let kept = Metadata {
        labels: original.metadata.labels.clone(),
        annotations: annotations.filter(|a| !a.is_empty()),
    };
    let annotations = BTreeMap::from([
        (SURGE_FOR.to_string(), args.daemonset.clone()),
        (ORIGINAL_METADATA.to_string(), serde_json::to_string(&kept)?),
    ]);
    Ok(DaemonSet {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: original.metadata.namespace.clone(),
            labels: spec.selector.match_labels.clone(),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// The original again: the copy's spec without the copy's label, with the new image,
/// under the original's name, labels and annotations.
fn original_of(surge: &DaemonSet, name: &str, args: &AgentsArgs) -> anyhow::Result<DaemonSet> {
    let mut spec = surge.spec.clone().context("the DaemonSet has no spec")?;
    mark(&mut spec, None);
    set_image(&mut spec, args)?;
    let kept: Metadata = surge
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ORIGINAL_METADATA))
        .map(|m| serde_json::from_str(m))
        .transpose()
        .with_context(|| {
            format!("the copy's {ORIGINAL_METADATA} annotation is not what tether rollout wrote")
        })?
        .unwrap_or_default();
    Ok(DaemonSet {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            namespace: surge.metadata.namespace.clone(),
            labels: kept.labels,
            annotations: kept.annotations,
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// How many of a DaemonSet's pods are up to date and ready, of how many it should run;
/// `None` until its controller has seen the current spec.
fn readiness(d: &DaemonSet) -> Option<(i32, i32)> {
    let status = d.status.as_ref()?;
    let generation = d.metadata.generation.unwrap_or(0);
    if status.observed_generation.unwrap_or(0) < generation {
        return None;
    }
    let desired = status.desired_number_scheduled;
    let up = status
        .updated_number_scheduled
        .unwrap_or(0)
        .min(status.number_ready)
        .min(status.number_available.unwrap_or(0));
    Some((up, desired))
}

/// The cluster, and when to give up.
struct Kube {
    sets: Api<DaemonSet>,
    pods: Api<Pod>,
    deadline: Instant,
}

impl Kube {
    /// Creates `d`; one that someone else made meanwhile is read again by the caller.
    async fn create(&self, d: &DaemonSet) -> anyhow::Result<()> {
        let name = d.metadata.name.as_deref().unwrap_or_default();
        match self.sets.create(&create_params(), d).await {
            Ok(_) => {
                println!(
                    "daemonset/{name} created with {}",
                    image(d, None).unwrap_or("its image")
                );
                Ok(())
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
            Err(e) => Err(e).with_context(|| format!("cannot create daemonset/{name}")),
        }
    }

    /// The nodes where `d` runs a pod (ready ones only if `ready`).
    async fn nodes(&self, d: &DaemonSet, ready: bool) -> anyhow::Result<BTreeSet<String>> {
        let uid = d.metadata.uid.as_deref().unwrap_or_default();
        let selector = d
            .spec
            .as_ref()
            .and_then(|s| s.selector.match_labels.as_ref())
            .map(|l| {
                l.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default();
        let pods = self
            .pods
            .list(&ListParams::default().labels(&selector))
            .await?;
        Ok(pods
            .items
            .iter()
            .filter(|p| owned_by(p, uid) && (!ready || pod_ready(p)))
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect())
    }

    /// Waits until `d` is up to date and ready on every node it should run on, and on
    /// every node where `cover` runs a pod; says `on_timeout` if not by the deadline.
    async fn ready(
        &self,
        d: &DaemonSet,
        cover: &DaemonSet,
        on_timeout: &str,
    ) -> anyhow::Result<()> {
        let name = d.metadata.name.as_deref().unwrap_or_default();
        let mut said = None;
        loop {
            let now = readiness(&self.sets.get(name).await?);
            // A DaemonSet covers its own nodes by its counts: no pod lists then.
            let missing: Vec<String> = if cover.metadata.uid == d.metadata.uid {
                Vec::new()
            } else {
                self.nodes(cover, false)
                    .await?
                    .difference(&self.nodes(d, true).await?)
                    .cloned()
                    .collect()
            };
            if now != said {
                if let Some((up, desired)) = now {
                    println!("daemonset/{name}: {up} of {desired} agents ready");
                }
                said = now;
            }
            if matches!(now, Some((up, desired)) if up >= desired) && missing.is_empty() {
                return Ok(());
            }
            if Instant::now() > self.deadline {
                let missing = if missing.is_empty() {
                    String::new()
                } else {
                    format!(" (none ready on {})", missing.join(", "))
                };
                bail!("daemonset/{name}: not every agent ready within --timeout{missing}; {on_timeout}");
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Deletes `d` (only the very object read: its uid) and waits until it and its pods
    /// are gone: its agents drain, and their tunnels run on until --drain-timeout ends
    /// them.
    async fn retire(&self, d: &DaemonSet) -> anyhow::Result<()> {
        let name = d.metadata.name.as_deref().unwrap_or_default();
        // Foreground: the DaemonSet stays until its pods are gone, so its name is free
        // only once no old agent is left.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: d.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::foreground()
        };
        match self.sets.delete(name, &params).await {
            Ok(_) => println!("daemonset/{name} deleted; its agents drain"),
            // Gone, or another object under the name: read again.
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => return Ok(()),
            Err(e) => return Err(e).with_context(|| format!("cannot delete daemonset/{name}")),
        }
        self.gone(name).await
    }

    /// Waits until `name` is gone.
    async fn gone(&self, name: &str) -> anyhow::Result<()> {
        while let Some(d) = self.sets.get_opt(name).await? {
            if Instant::now() > self.deadline {
                let left = self.nodes(&d, false).await.unwrap_or_default();
                bail!(
                    "daemonset/{name} is still there at --timeout, with pods on {}: a pod on a node that is down stays until the node is removed or the pod force-deleted (kubectl delete pod --force --grace-period=0); then run again",
                    left.into_iter().collect::<Vec<_>>().join(", ")
                );
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        println!("daemonset/{name} gone");
        Ok(())
    }
}

/// Whether `pod` is controlled by the object with `uid`.
fn owned_by(pod: &Pod, uid: &str) -> bool {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// Whether `pod` is Ready and not on its way out.
fn pod_ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DaemonSetSpec;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    fn args() -> AgentsArgs {
        AgentsArgs {
            image: "tether:b".into(),
            daemonset: "konnectivity-agent".into(),
            namespace: "kube-system".into(),
            container: None,
            kubeconfig: None,
            timeout: Duration::from_secs(1),
        }
    }

    fn daemonset(name: &str, image: &str) -> DaemonSet {
        let labels: BTreeMap<String, String> =
            [("k8s-app".to_string(), "konnectivity-agent".to_string())].into();
        DaemonSet {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("kube-system".into()),
                labels: Some(labels.clone()),
                annotations: Some(
                    [(
                        "kubectl.kubernetes.io/last-applied-configuration".to_string(),
                        "{}".to_string(),
                    )]
                    .into(),
                ),
                uid: Some("u".into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            spec: Some(DaemonSetSpec {
                selector: LabelSelector {
                    match_labels: Some(labels.clone()),
                    ..Default::default()
                },
                template: PodTemplateSpec {
                    metadata: Some(kube::api::ObjectMeta {
                        labels: Some(labels),
                        ..Default::default()
                    }),
                    spec: Some(PodSpec {
                        containers: vec![Container {
                            name: "konnectivity-agent".into(),
                            image: Some(image.into()),
                            ..Default::default()
                        }],
                        ..Default::default()
                    }),
                },
                ..Default::default()
            }),
            status: None,
        }
    }

    /// `d` as kube-apiserver shows it once deleted in the foreground: a deletion
    /// timestamp, and one generation more.
    fn deleting(mut d: DaemonSet) -> DaemonSet {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        d.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        d.metadata.generation = Some(d.metadata.generation.unwrap_or(1) + 1);
        d
    }

    #[test]
    fn the_copy_has_a_selector_of_its_own_and_the_original_comes_back_as_it_was() {
        let mut original = daemonset("konnectivity-agent", "tether:a");
        original
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(TEMPLATE_GENERATION.into(), "4".into());
        let surge = surge_of(&original, "konnectivity-agent-surge", &args()).unwrap();
        assert_eq!(image(&surge, None).unwrap(), "tether:b");
        let spec = surge.spec.as_ref().unwrap();
        assert_eq!(
            spec.selector.match_labels.as_ref().unwrap()[SET_LABEL],
            "surge"
        );
        let pod_labels = spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .labels
            .as_ref()
            .unwrap();
        assert_eq!(pod_labels[SET_LABEL], "surge");
        assert_eq!(pod_labels["k8s-app"], "konnectivity-agent");
        assert!(surge.metadata.uid.is_none() && surge.metadata.resource_version.is_none());
        // Neither the original's annotations (last-applied: a pruning apply would take
        // the copy for its own) nor labels beyond the selector's.
        let annotations = surge.metadata.annotations.as_ref().unwrap();
        assert!(!annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"));
        assert_eq!(annotations[SURGE_FOR], "konnectivity-agent");
        assert_eq!(surge.metadata.labels, spec.selector.match_labels);

        let again = original_of(&surge, "konnectivity-agent", &args()).unwrap();
        let mut expected = original.clone();
        expected.metadata.uid = None;
        expected.metadata.resource_version = None;
        expected
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(TEMPLATE_GENERATION);
        let spec = expected.spec.as_mut().unwrap();
        spec.template.spec.as_mut().unwrap().containers[0].image = Some("tether:b".into());
        assert_eq!(again, expected);
    }

    #[test]
    fn each_state_has_its_step() {
        let a = args();
        let old = daemonset("konnectivity-agent", "tether:a");
        let new = daemonset("konnectivity-agent", "tether:b");
        let surge = surge_of(&old, "konnectivity-agent-surge", &a).unwrap();
        let step = |o: Option<&DaemonSet>, s: Option<&DaemonSet>| step(o, s, &a).unwrap();
        assert_eq!(step(Some(&old), None), Step::MakeSurge);
        assert_eq!(step(Some(&deleting(old.clone())), None), Step::MakeSurge);
        assert_eq!(step(Some(&old), Some(&surge)), Step::ReplaceOriginal);
        assert_eq!(
            step(Some(&deleting(old.clone())), Some(&surge)),
            Step::AwaitOriginalGone
        );
        assert_eq!(step(None, Some(&surge)), Step::MakeOriginal);
        assert_eq!(
            step(None, Some(&deleting(surge.clone()))),
            Step::MakeOriginal
        );
        assert_eq!(step(Some(&new), Some(&surge)), Step::RetireSurge);
        assert_eq!(
            step(Some(&new), Some(&deleting(surge.clone()))),
            Step::AwaitSurgeGone
        );
        assert_eq!(step(Some(&new), None), Step::Done);
        // The original deleted by someone after it was made again: made once more.
        assert_eq!(
            step(Some(&deleting(new.clone())), Some(&surge)),
            Step::AwaitOriginalGone
        );
    }

    #[test]
    fn what_it_will_not_do_says_what_to_do() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let a = args();
        let old = daemonset("konnectivity-agent", "tether:a");
        let surge = surge_of(&old, "konnectivity-agent-surge", &a).unwrap();
        let refused = |o: Option<&DaemonSet>, s: Option<&DaemonSet>, a: &AgentsArgs| {
            step(o, s, a).unwrap_err().to_string()
        };
        let other = AgentsArgs {
            image: "tether:c".into(),
            ..args()
        };
        assert!(refused(Some(&old), Some(&surge), &other).contains("--image tether:b"));
        assert!(refused(None, None, &a).contains("--daemonset"));
        // A copy somebody else made, or changed since: its spec never becomes the
        // original's.
        let mut planted = surge.clone();
        planted.metadata.annotations = None;
        assert!(refused(None, Some(&planted), &a).contains("not made by tether rollout"));
        let mut changed = surge.clone();
        changed.metadata.generation = Some(2);
        assert!(refused(None, Some(&changed), &a).contains("changed after"));
        assert!(refused(None, Some(&deleting(changed)), &a).contains("changed after"));
        // An original an operator owns goes through that operator.
        let mut owned = old.clone();
        let owner = k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            kind: "Agents".into(),
            name: "fleet".into(),
            ..Default::default()
        };
        owned.metadata.owner_references = Some(vec![owner.clone()]);
        // (An owner that does not control it is no bar.)
        assert_eq!(step(Some(&owned), None, &a).unwrap(), Step::MakeSurge);
        owned.metadata.owner_references = Some(vec![OwnerReference {
            controller: Some(true),
            ..owner
        }]);
        assert!(refused(Some(&owned), None, &a).contains("Agents/fleet"));
    }

    #[test]
    fn readiness_waits_for_the_controller_and_every_node() {
        use k8s_openapi::api::apps::v1::DaemonSetStatus;
        let mut d = daemonset("konnectivity-agent-surge", "tether:b");
        d.metadata.generation = Some(1);
        assert_eq!(readiness(&d), None);
        d.status = Some(DaemonSetStatus {
            observed_generation: Some(1),
            desired_number_scheduled: 3,
            updated_number_scheduled: Some(3),
            number_ready: 2,
            number_available: Some(2),
            ..Default::default()
        });
        assert_eq!(readiness(&d), Some((2, 3)));
    }
}
