// Volumes: disks of the tenant's own that outlive its sandboxes.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, StateBadge, ago, mib, usePoll } from "../ui.jsx";

function CreateVolume({ onClose, onCreated }) {
  const [name, setName] = useState("");
  const [size, setSize] = useState(1024);
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      await json("POST", "/v1/volumes", { body: { name, size_mib: Number(size) } });
      onCreated();
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title="New volume"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="volume" disabled={busy}>
            {busy ? <Spinner label="Creating" /> : "Create volume"}
          </button>
        </>
      }
    >
      <form id="volume" class="grid2" onSubmit={submit}>
        <Field label="Name">
          <input name="name" value={name} onInput={(e) => setName(e.target.value)} placeholder="datasets" />
        </Field>
        <Field label="Size (MiB)" hint="16 MiB to 1 TiB; sparse until written">
          <input name="size_mib" type="number" min="16" value={size} onInput={(e) => setSize(e.target.value)} />
        </Field>
      </form>
      <ErrorBox error={error} title="Not created" />
    </Dialog>
  );
}

export function Volumes() {
  const { data, error, loading, reload } = usePoll(() => get("/v1/volumes"), 5000);
  const [creating, setCreating] = useState(false);
  const [deleting, setDeleting] = useState(null);
  const items = (data?.items || []).filter((v) => v.state !== "deleted");
  return (
    <section>
      <PageHeader title="Volumes" subtitle="ext4 disks of your own that outlive sandboxes. Mount one at create: --volume ID:/path.">
        <button class="primary" onClick={() => setCreating(true)}>
          New volume
        </button>
      </PageHeader>
      <ErrorBox error={error} title="Volumes not loaded" />
      {loading && !data ? (
        <Spinner label="Loading volumes" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No volumes" action={<button class="primary" onClick={() => setCreating(true)}>Create a volume</button>}>
            A volume keeps its files when the sandboxes that used it are gone.
          </Empty>
        </div>
      ) : (
        <div class="card">
          <table class="table" id="volumes">
            <thead>
              <tr>
                <th>Volume</th>
                <th>Name</th>
                <th>Size</th>
                <th>State</th>
                <th>Created</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((v) => (
                <tr key={v.id}>
                  <td class="mono">{v.id}</td>
                  <td>{v.name || <span class="muted">—</span>}</td>
                  <td class="muted">{mib(v.size_mib)}</td>
                  <td>
                    <StateBadge state={v.state} />
                  </td>
                  <td class="muted">{ago(v.created_at)}</td>
                  <td class="right">
                    <button class="ghost small" onClick={() => setDeleting(v)}>
                      Delete
                    </button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {creating && (
        <CreateVolume
          onClose={() => setCreating(false)}
          onCreated={() => {
            setCreating(false);
            reload();
          }}
        />
      )}
      {deleting && (
        <Confirm title={`Delete ${deleting.name || deleting.id}?`} action="Delete" danger onClose={() => setDeleting(null)} onConfirm={async () => { await json("DELETE", `/v1/volumes/${deleting.id}`); await reload(); }}>
          <p>Its data is gone for good. A volume a sandbox still uses cannot be deleted.</p>
        </Confirm>
      )}
    </section>
  );
}
