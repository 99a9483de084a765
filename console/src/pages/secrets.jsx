// Secrets: names only. A value goes in and never comes out; sandboxes use secrets by binding
// them to hosts, and the gateway adds them on the way out.
import { useState } from "preact/hooks";
import { get, json } from "../api.js";
import { Confirm, Dialog, Empty, ErrorBox, Field, PageHeader, Spinner, ago, usePoll } from "../ui.jsx";

function SetSecret({ onClose, onSaved }) {
  const [name, setName] = useState("");
  const [value, setValue] = useState("");
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(null);
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    try {
      await json("PUT", `/v1/secrets/${encodeURIComponent(name)}`, { body: { value } });
      setValue("");
      onSaved();
    } catch (err) {
      setError(err);
      setBusy(false);
    }
  };
  return (
    <Dialog
      title="Set a secret"
      onClose={onClose}
      footer={
        <>
          <button class="ghost" onClick={onClose}>
            Cancel
          </button>
          <button class="primary" type="submit" form="secret" disabled={busy || !name || !value}>
            {busy ? <Spinner label="Sealing" /> : "Save"}
          </button>
        </>
      }
    >
      <form id="secret" onSubmit={submit}>
        <Field label="Name" hint="a secret of that name is replaced">
          <input name="name" value={name} onInput={(e) => setName(e.target.value)} placeholder="github" />
        </Field>
        <Field label="Value" hint="sealed at rest; nobody can read it back, this console included">
          <input name="value" type="password" autocomplete="off" value={value} onInput={(e) => setValue(e.target.value)} />
        </Field>
      </form>
      <ErrorBox error={error} title="Not saved" />
    </Dialog>
  );
}

export function Secrets() {
  const { data, error, loading, reload } = usePoll(() => get("/v1/secrets"), 10000);
  const [setting, setSetting] = useState(false);
  const [deleting, setDeleting] = useState(null);
  const items = data?.items || [];
  return (
    <section>
      <PageHeader title="Secrets" subtitle="Credentials the gateway adds to requests to the hosts you bind them to. Guests only ever see a placeholder.">
        <button class="primary" onClick={() => setSetting(true)}>
          Set a secret
        </button>
      </PageHeader>
      <ErrorBox error={error} title="Secrets not loaded" />
      {loading && !data ? (
        <Spinner label="Loading secrets" />
      ) : !items.length ? (
        <div class="card">
          <Empty title="No secrets">Bind one at create: "secrets": [{"{"}"secret": "github", "hosts": ["api.github.com"], "env": "GITHUB_TOKEN"{"}"}].</Empty>
        </div>
      ) : (
        <div class="card">
          <table class="table" id="secrets">
            <thead>
              <tr>
                <th>Name</th>
                <th>Value</th>
                <th>Created</th>
                <th>Updated</th>
                <th />
              </tr>
            </thead>
            <tbody>
              {items.map((s) => (
                <tr key={s.name}>
                  <td class="mono">{s.name}</td>
                  <td class="muted">•••••• sealed</td>
                  <td class="muted">{ago(s.created_at)}</td>
                  <td class="muted">{ago(s.updated_at)}</td>
                  <td class="right">
                    <button class="ghost small" onClick={() => setDeleting(s)}>
                      Delete
                    </button>
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      )}
      {setting && (
        <SetSecret
          onClose={() => setSetting(false)}
          onSaved={() => {
            setSetting(false);
            reload();
          }}
        />
      )}
      {deleting && (
        <Confirm title={`Delete ${deleting.name}?`} action="Delete" danger onClose={() => setDeleting(null)} onConfirm={async () => { await json("DELETE", `/v1/secrets/${encodeURIComponent(deleting.name)}`); await reload(); }}>
          <p>A secret bound to a sandbox that is not deleted cannot be deleted.</p>
        </Confirm>
      )}
    </section>
  );
}
