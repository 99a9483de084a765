// A file browser of a running sandbox over the files API: folders to walk, files to download,
// uploads (streamed to the sandbox as they are), new folders and deletes.
import { useRef, useState } from "preact/hooks";
import { call, download, get, json, sandboxPath } from "../api.js";
import { Confirm, Empty, ErrorBox, Field, Spinner, ago, bytes, usePoll } from "../ui.jsx";

const join = (dir, name) => (dir.endsWith("/") ? dir : `${dir}/`) + name;
const parent = (dir) => dir.replace(/\/[^/]+\/?$/, "") || "/";
const mode = (m) => (m & 0o7777).toString(8).padStart(4, "0");

function NewFolder({ dir, onClose, onCreate }) {
  const [name, setName] = useState("");
  return (
    <Confirm title="New folder" action="Create" onClose={onClose} onConfirm={() => onCreate(name.trim())}>
      <Field label={`Name, in ${dir}`}>
        <input name="folder" value={name} onInput={(e) => setName(e.target.value)} autofocus />
      </Field>
    </Confirm>
  );
}

export function Files({ id }) {
  const [dir, setDir] = useState("/root");
  const [busy, setBusy] = useState(null);
  const [error, setError] = useState(null);
  const [removing, setRemoving] = useState(null);
  const picker = useRef(null);
  const list = usePoll(() => get(sandboxPath(id, "/files/list"), { query: { path: dir } }), 0, [id, dir]);
  const entries = [...(list.data?.entries || [])].sort((a, b) => (a.type === "directory") === (b.type === "directory") ? a.name.localeCompare(b.name) : a.type === "directory" ? -1 : 1);

  const doing = async (what, work) => {
    setBusy(what);
    setError(null);
    try {
      await work();
      await list.reload();
    } catch (e) {
      setError(e);
    }
    setBusy(null);
  };
  const upload = (files) =>
    doing(`Uploading ${files.length === 1 ? files[0].name : `${files.length} files`}`, async () => {
      for (const file of files) {
        await call("PUT", sandboxPath(id, "/files"), { raw: file, query: { path: join(dir, file.name) } });
      }
    });
  const [naming, setNaming] = useState(false);
  const mkdir = (name) => json("POST", sandboxPath(id, "/files/mkdir"), { query: { path: join(dir, name) } }).then(list.reload);
  const crumbs = dir.split("/").filter(Boolean);
  return (
    <div class="card">
      <div class="files-bar">
        <nav class="path" aria-label="Folder">
          <button class="link" onClick={() => setDir("/")}>
            /
          </button>
          {crumbs.map((c, i) => (
            <span key={i}>
              <button class="link" onClick={() => setDir(`/${crumbs.slice(0, i + 1).join("/")}`)}>
                {c}
              </button>
              {i < crumbs.length - 1 && "/"}
            </span>
          ))}
        </nav>
        <div class="actions">
          {busy && <Spinner label={busy} />}
          <button class="ghost small" onClick={() => setNaming(true)} disabled={busy !== null}>
            New folder
          </button>
          <button class="primary small" onClick={() => picker.current.click()} disabled={busy !== null}>
            Upload
          </button>
          <input ref={picker} type="file" multiple hidden id="upload" onChange={(e) => e.target.files.length && upload([...e.target.files])} />
        </div>
      </div>
      <ErrorBox error={error} title="Not done" />
      <ErrorBox error={list.error} title="Folder not read" />
      {list.loading && !list.data ? (
        <div class="pad">
          <Spinner label="Reading the folder" />
        </div>
      ) : (
        <table class="table" id="files">
          <thead>
            <tr>
              <th>Name</th>
              <th>Size</th>
              <th>Mode</th>
              <th>Modified</th>
              <th />
            </tr>
          </thead>
          <tbody>
            {dir !== "/" && (
              <tr>
                <td colSpan="5">
                  <button class="link" onClick={() => setDir(parent(dir))}>
                    ↰ ..
                  </button>
                </td>
              </tr>
            )}
            {entries.map((e) => (
              <tr key={e.path} data-name={e.name}>
                <td>
                  {e.type === "directory" ? (
                    <button class="link file-dir" onClick={() => setDir(e.path)}>
                      {e.name}/
                    </button>
                  ) : (
                    <button class="link file" title="Download" onClick={() => doing(`Downloading ${e.name}`, () => download(`${sandboxPath(id, "/files")}?path=${encodeURIComponent(e.path)}`, e.name))}>
                      {e.name}
                    </button>
                  )}
                </td>
                <td class="muted">{e.type === "directory" ? "—" : bytes(e.size)}</td>
                <td class="mono muted">{mode(e.mode)}</td>
                <td class="muted">{ago(e.mtime * 1000)}</td>
                <td class="right">
                  <button class="ghost small" onClick={() => setRemoving(e)}>
                    Delete
                  </button>
                </td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {list.data && !entries.length && <Empty title="This folder is empty">Upload a file to put it here.</Empty>}
      {naming && <NewFolder dir={dir} onClose={() => setNaming(false)} onCreate={mkdir} />}
      {removing && (
        <Confirm
          title={`Delete ${removing.name}?`}
          action="Delete"
          danger
          onClose={() => setRemoving(null)}
          onConfirm={async () => {
            await call("DELETE", sandboxPath(id, "/files"), { query: { path: removing.path, recursive: removing.type === "directory" } });
            await list.reload();
          }}
        >
          <p>{removing.type === "directory" ? "The folder and everything in it is removed from the sandbox." : "The file is removed from the sandbox."}</p>
        </Confirm>
      )}
    </div>
  );
}
